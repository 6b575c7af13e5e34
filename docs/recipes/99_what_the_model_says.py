# Title: What the model says: its own answer, token by token
# SmolLM2-Instruct answers a chat message; every token of the answer attributed per head, against its runner-up.
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
chat = [{"role": "user", "content": "What is the opposite of hot? One word."}]
attr = dla_recipes.attribute_generation(model, chat, max_new_tokens=12, contrast="runner-up", by="head")
print(attr.generation.texts[0])  # the model's own (greedy) answer, through its <|im_end|>
assert attr.error < 1e-4 * float(attr.logit.nan_to_num().abs().max())  # each step's parts sum to its logit
step = list(attr.target_tokens[0]).index(" cold")  # the step where the answer is decided
print(f"step {step}: {attr.target_tokens[0][step]!r} over its runner-up {attr.contrast_tokens[0][step]!r}")
display(attr.top(6, position=step, kind="head"))  # the heads that chose " cold" over the runner-up
plots.show(plots.top_components_heatmap(attr, k=10, kind="head"))  # the answer's tokens x its top heads
