# Title: Top neurons
# Each of SmolLM2's 30 x 1536 MLP neurons as a component of logit(" Paris") - logit(" Rome"): the largest ones.
import re

import nnsight
import torch
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
prompt = "The Eiffel Tower is in the city of"
neurons = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="neuron")
print(f"{len(neurons.labels)} components, parts + constant {float(neurons.total[0]):+.4f} = logit difference "
      f"{float(neurons.logit[0]):+.4f} (error {neurons.error:.1e})")
display(plots.top_table(neurons, k=10))

top = neurons.top(40)
top = top[top["component"].str.contains(r"\.N")].head(5)  # neurons only: attention and embedding stay whole
where = [tuple(int(x) for x in re.findall(r"\d+", label)) for label in top["component"]]  # (layer, neuron)
acts = []  # bound outside the trace, filled inside
with torch.no_grad(), model.trace(prompt):  # their activations at the last token: the down projection's input
    for layer, n in sorted(where):
        acts.append(nnsight.save(dla_recipes.trace.neuron_activations(model, layer)[0, -1, n]))
print("activations:", {f"L{layer}.N{n}": round(float(a), 3) for (layer, n), a in zip(sorted(where), acts)})
plots.show(plots.top_bar(neurons, k=20))
