# Title: Ablate, then attribute
# Zero each of the top 5 heads in turn and compare its direct part with the change of the logit difference: direct attribution is not the causal effect.
import plotly.graph_objects as go

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
prompt, target, contrast = "The Eiffel Tower is in the city of", " Paris", " Rome"

clean = dla_recipes.attribute(model, prompt, target, contrast=contrast, by="head")
heads = [label for label in clean.top(60)["component"] if ".H" in label][:5]


def ablate(layer, head):
    hs = dla_recipes.head_slice(model, layer, head)  # the head's features of o_proj's input (its width is o_proj's)

    def edit(m):  # nnsight code, run in the same forward pass as the attribution
        hs.site(m).input[hs.index] = 0  # m.layers[layer].self_attn.o_proj.input[..., hs.columns] = 0
    return edit


direct, total = [], []
for label in heads:
    layer, head = (int(n) for n in label[1:].split(".H"))
    edited = dla_recipes.attribute(model, prompt, target, contrast=contrast, by="head", intervene=ablate(layer, head))
    assert edited.values[0, edited.labels.index(label)] == 0  # the ablated head writes nothing
    direct.append(float(clean.values[0, clean.labels.index(label)]))
    total.append(float(edited.logit[0] - clean.logit[0]))  # exact: the parts sum to the edited model's own logit
    print(f"{label}: direct {direct[-1]:+.3f}, change when ablated {total[-1]:+.3f} (self-check error {edited.error:.1e})")

span = max(map(abs, direct + total)) * 1.15
fig = go.Figure([
    go.Scatter(x=[span, -span], y=[-span, span], mode="lines", line={"dash": "dot", "color": "gray"},
               name="change = −direct"),
    go.Scatter(x=direct, y=total, mode="markers+text", text=heads, textposition="top center", name="head"),
])
fig.update_layout(template="plotly_white", height=440, xaxis_title="direct part", yaxis_title="change when ablated",
                  title=f"{target!r} − {contrast!r}: direct attribution vs total effect")
plots.show(fig, div_id="recipe-ablate", static=False)
