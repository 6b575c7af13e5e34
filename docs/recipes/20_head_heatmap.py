# Title: Per head: a layer x head heatmap
# Every attention head's direct part of logit(" Paris") - logit(" Rome") on SmolLM2: a heatmap and the ten largest.
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
heads = dla_recipes.attribute(model, "The Eiffel Tower is in the city of", " Paris", contrast=" Rome", by="head")
print(heads)  # L29.H1: block 29, head 1; a block label (L29.attn) would hold what no head owns: SmolLM2 has no bias
display(plots.top_table(heads, k=10))
plots.show(plots.heads_heatmap(heads))
