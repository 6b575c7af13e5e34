# Title: A logit difference over a small dataset
# Eight landmark prompts, each attributed (right city minus a wrong one) per block: each component's mean and spread.
import pandas as pd
import plotly.graph_objects as go
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
data = [  # prompt, right city, a wrong city
    ("The Eiffel Tower is in the city of", " Paris", " Rome"),
    ("The Colosseum is in the city of", " Rome", " Paris"),
    ("Big Ben is in the city of", " London", " Berlin"),
    ("The Brandenburg Gate is in the city of", " Berlin", " London"),
    ("The Acropolis is in the city of", " Athens", " Madrid"),
    ("The Prado Museum is in the city of", " Madrid", " Athens"),
    ("The Kremlin is in the city of", " Moscow", " Tokyo"),
    ("Tokyo Tower is in the city of", " Tokyo", " Moscow"),
]
prompts, right, wrong = zip(*data)
attr = dla_recipes.attribute(model, list(prompts), list(right), contrast=list(wrong))  # one padded batch
frame = attr.to_frame().drop(index=["constant", "logit"])  # [components, prompts]
stats = pd.DataFrame({"mean": frame.mean(axis=1), "std": frame.std(axis=1), "share > 0": (frame > 0).mean(axis=1)})
print(f"logit differences: {[round(x, 2) for x in attr.logit.tolist()]}, largest error {attr.error:.1e}")
largest = stats.reindex(stats["mean"].abs().sort_values(ascending=False).index).head(8)
display(largest.style.format({"mean": "{:+.3f}", "std": "{:.3f}", "share > 0": "{:.0%}"}))

fig = go.Figure(go.Bar(x=stats.index, y=stats["mean"], error_y={"type": "data", "array": stats["std"]}))
fig.update_layout(title=f"Mean ± std over {len(attr)} prompts: logit(right city) - logit(wrong city)",
                  xaxis={"tickangle": -60, "tickfont": {"size": 9}}, yaxis_title="contribution",
                  template="plotly_white", height=420)
plots.show(fig)
