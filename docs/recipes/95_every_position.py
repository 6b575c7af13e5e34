# Title: Every position: what predicted each token
# Every token of a sentence on SmolLM2, each position's next token attributed per head in one forward pass.
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
sentence = "The Eiffel Tower, which was finished in 1889, stands in the city of Paris."
attr = dla_recipes.attribute(model, sentence, "next", position="all", by="head")  # one forward pass, every position
print(attr)  # values [1 prompt, 21 positions, components]: position p's part of logit(token p + 1)
assert attr.error < 1e-4 * float(attr.logit.nan_to_num().abs().max())  # each site's parts sum to its logit
k = len(model.tokenizer(sentence)["input_ids"]) - 3  # "... city of" -> " Paris"
display(attr.top(6, position=k, kind="head"))  # the heads that wrote " Paris" there
blocks = attr.blocks()  # heads summed into their blocks: [1, 21, 61]
strongest = blocks.labels[int(blocks.values[0].abs().nansum(0).argmax())]  # the largest block over the sentence
display(plots.token_text(attr, component=strongest))  # its part, token by token (hover for the values)
plots.show(plots.positions_heatmap(attr))  # blocks x positions: heads summed into their blocks
