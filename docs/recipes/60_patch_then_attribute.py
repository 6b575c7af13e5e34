# Title: Patch, then attribute
# Put one head's output from a corrupted prompt into the clean prompt's forward pass, in one trace, and attribute the clean logit difference.
import torch

import dla_recipes
from dla_recipes import models, plots, trace_attribution

model = dla_recipes.load(models.default_model_path())
clean, corrupted = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
layer, head = model.num_layers - 1, 0
hs = dla_recipes.head_slice(model, layer, head)  # the head's features of o_proj's input: hs.site(model).input[hs.index]

with torch.no_grad(), model.trace() as tracer:  # no input here: one invoke per prompt
    with tracer.invoke(corrupted):
        from_corrupted = hs.site(model).input[:, -1][hs.index]  # the head's output, last token
    with tracer.invoke(clean):
        heads_in = hs.site(model).input  # read the site first, then edit it in place
        heads_in[:, -1][hs.index] = from_corrupted
    dla = trace_attribution(tracer, " Paris", contrast=" Rome", by="head")  # after the invokes: both rows

patched = dla.result()  # row 0: the corrupted prompt; row 1: the clean prompt with the head patched
unpatched = dla_recipes.attribute(model, clean, " Paris", contrast=" Rome", by="head")
print(f"clean logit difference {float(unpatched.logit[0]):.3f} -> patched {float(patched.logit[1]):.3f} "
      f"(self-check error {patched.error:.1e}); L{layer}.H{head}'s direct part "
      f"{float(unpatched.values[0, unpatched.labels.index(f'L{layer}.H{head}')]):+.3f} -> "
      f"{float(patched.values[1, patched.labels.index(f'L{layer}.H{head}')]):+.3f}")
plots.show(plots.top_bar(patched, k=15, prompt=1), div_id="recipe-patch")
