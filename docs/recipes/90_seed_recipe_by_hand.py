# Title: The recipe by hand: readers and a frozen norm, no attribute()
# Each step of DLA on SmolLM2, per block and per head, with the in-trace readers and FrozenNorm, against its logit.
import nnsight
import pandas as pd
import plotly.graph_objects as go
import torch

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())  # Llama family: pre-norm blocks, RMSNorm, no biases
prompt, n = "The Eiffel Tower is in the city of", model.num_layers
paris, rome = (model.tokenizer.encode(t, add_special_tokens=False)[0] for t in (" Paris", " Rome"))

terms, heads = {}, []  # bound outside the trace: the trace fills them with saved values
with torch.no_grad(), model.trace(prompt):  # read in forward order, at the last position: [d_model] each
    terms["embed"] = nnsight.save(dla_recipes.trace.layer_input(model, 0)[0, -1])  # block 0's input: the embedding
    for i in range(n):
        heads.append(nnsight.save(dla_recipes.trace.attention_head_outputs(model, i)[0, -1]))  # [heads, head_dim]
        terms[f"L{i}.attn"] = nnsight.save(dla_recipes.trace.attention_output(model, i)[0, -1])
        terms[f"L{i}.mlp"] = nnsight.save(dla_recipes.trace.mlp_output(model, i)[0, -1])
    stream = nnsight.save(dla_recipes.trace.layer_output(model, n - 1)[0, -1])  # what the final norm reads
    normed = nnsight.save(model.ln_final.output[0, -1])  # what it returns
    logits = nnsight.save(model.logits[0, -1])  # the model's own logits
print("stream == sum of terms:", torch.allclose(sum(terms.values()), stream, atol=1e-4))

with torch.no_grad():
    frozen = dla_recipes.math.FrozenNorm(model.ln_final._module, stream, output=normed)  # probes, then fits the scale
    row = model.lm_head.weight[paris] - model.lm_head.weight[rome]  # the unembedding of the difference
    dla = pd.Series({name: float(frozen(term) @ row) for name, term in terms.items()})
    constant = float(frozen.bias @ row)  # the norm's bias (zero on RMSNorm; lm_head has none)
    target = float(logits[paris] - logits[rome])
    print(f"sum of parts + constant {dla.sum() + constant:+.5f}, model's logit difference {target:+.5f}")
    assert abs(dla.sum() + constant - target) <= 1e-4 * max(1.0, abs(target))

    per_head = {}  # o_proj's weight is [d_model, heads * head_dim]: head k's write is its slice times its columns
    for i, h in enumerate(heads):  # h: [heads, head_dim]
        writes = torch.einsum("hd,ohd->ho", h, model.layers[i].self_attn.o_proj.weight.unflatten(1, h.shape))
        assert torch.allclose(writes.sum(0), terms[f"L{i}.attn"], atol=1e-4)  # the heads sum to the attention
        per_head.update({f"L{i}.H{k}": float(frozen(write) @ row) for k, write in enumerate(writes)})
per_head = pd.Series(per_head)
print("largest heads:", per_head[per_head.abs().sort_values(ascending=False).index[:5]].round(4).to_dict())
plots.show(go.Figure(go.Bar(x=dla.index, y=dla.values), layout={"title": "DLA per block, by hand", "height": 350}))
