# Title: Why the head attended
# IOI on SmolLM2: the head writing the most " Mary" - " John", then which query-side and key-side component pairs
# make its score on " Mary" and on the first " John" (the page "Why the head attended" follows it further).
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
prompt = "When Mary and John went to the store, John gave a drink to"
heads = dla_recipes.attribute(model, prompt, " Mary", contrast=" John", by="head")
mover = heads.top(1, kind="head", by_abs=False)["component"].iloc[0]  # the head writing the most " Mary" - " John"
tokens = model.tokenizer.convert_ids_to_tokens(model.tokenizer(prompt)["input_ids"])
mary, john = tokens.index("ĠMary"), tokens.index("ĠJohn")  # the first " Mary" and the first " John"
scores = dla_recipes.attribute_scores(model, prompt, mover, query=-1, keys=[mary, john], by="head")
print(mover, "scores (the model's own, pre-softmax):", scores.score[0].tolist())
assert float(scores.error.max()) < 1e-4  # values.sum + constant == the model's own score, per key
display(scores.top(8, key=0))  # the query x key pairs behind its score on " Mary"
why = scores.difference(0, 0, 1)  # " Mary" minus " John": what the softmax sees
plots.show(scores.heatmap(matrix=why, k=10, title=f"{mover}: score(' Mary') - score(' John'), by component pair"))
