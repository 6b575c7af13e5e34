# Title: Any norm and direction
# Which heads wrote a difference-of-means direction into what block 20's MLP reads, through the norm that reads it.
import nnsight
import torch
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
layer = 20
paris = ["The Eiffel Tower is in the city of", "The Louvre is a museum in the city of"]
rome = ["The Colosseum is in the city of", "The Trevi Fountain is in the city of"]
with torch.no_grad(), model.trace(paris + rome):  # what block 20's MLP reads: its norm's output, last token
    reads = nnsight.save(model.layers[layer].post_attention_layernorm.output[:, -1])
v = reads[:2].mean(0) - reads[2:].mean(0)  # [d_model]: Paris minus Rome, as block 20's MLP sees it

heads = dla_recipes.attribute_direction(model, paris + rome, v, layer=layer, sublayer="mlp", by="head")
print(heads)
print("norm(stream) · v from the norm's own output:", [round(x, 4) for x in (reads @ v).tolist()])
torch.testing.assert_close(heads.total, (reads @ v).float(), rtol=1e-4, atol=1e-4)  # the parts sum to it
quantity = f"ln2(stream) · v at L{layer}.mlp"
display(plots.top_table(heads, k=8, quantity=quantity))
plots.show(plots.heads_heatmap(heads, quantity=quantity))
