# Title: Per block: which blocks wrote the logit
# What the embedding and each attention and MLP of SmolLM2 wrote into logit(" Paris") - logit(" Rome"), summing to it.
import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())  # SmolLM2-135M-Instruct; any hub id or folder works too
attr = dla_recipes.attribute(model, "The Eiffel Tower is in the city of", " Paris", contrast=" Rome")
assert attr.error < 1e-4 * max(1.0, abs(float(attr.logit[0])))  # values.sum(-1) + constant == the model's logit
print(attr)
print(attr.top(5))  # the largest blocks; attr.to_frame() has them all (pandas)
plots.show(plots.blocks_bar(attr))  # pip install "dla_recipes[plots]"
