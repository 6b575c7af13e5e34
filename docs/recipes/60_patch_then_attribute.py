# Title: Patch, then attribute
# Put one head's output from a corrupted prompt into the clean prompt's forward pass, in one trace, and attribute the clean logit difference.
import torch

import dla_recipes
from dla_recipes import models, plots, trace_attribution

model = dla_recipes.load(models.default_model_path())
clean, corrupted = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
layer, head = 29, 0
cols = slice(head * model.config.hidden_size // model.num_heads, (head + 1) * model.config.hidden_size // model.num_heads)

with torch.no_grad(), model.trace() as tracer:  # no input here: one invoke per prompt
    with tracer.invoke(corrupted):
        from_corrupted = model.layers[layer].self_attn.o_proj.input[:, -1, cols]  # the head's output, last token
    with tracer.invoke(clean):
        heads_in = model.layers[layer].self_attn.o_proj.input  # read the site first, then edit it in place
        heads_in[:, -1, cols] = from_corrupted
    dla = trace_attribution(tracer, " Paris", contrast=" Rome", by="head")  # after the invokes: both rows

patched = dla.result()  # row 0: the corrupted prompt; row 1: the clean prompt with L29.H0 patched
unpatched = dla_recipes.attribute(model, clean, " Paris", contrast=" Rome", by="head")
print(f"clean logit difference {float(unpatched.logit[0]):.3f} -> patched {float(patched.logit[1]):.3f} "
      f"(self-check error {patched.error:.1e}); L{layer}.H{head}'s direct part "
      f"{float(unpatched.values[0, unpatched.labels.index(f'L{layer}.H{head}')]):+.3f} -> "
      f"{float(patched.values[1, patched.labels.index(f'L{layer}.H{head}')]):+.3f}")
plots.show(plots.top_bar(patched, k=15, prompt=1), div_id="recipe-patch")
