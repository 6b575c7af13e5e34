# Title: Remote on NDIF
# The per-head attribution computed on an NDIF server, next to the model; only one row of numbers per prompt comes back.
import os

import dla_recipes
from dla_recipes import plots

# Before Python starts: export NDIF_API_KEY=... (from login.ndif.us); nnsight reads it, and NDIF_HOST if you set
# one (default https://api.ndif.us), at import.
model = dla_recipes.load(os.environ.get("NDIF_MODEL", "meta-llama/Llama-3.1-8B"), remote=True)  # no weights here
heads = dla_recipes.attribute(model, "The Eiffel Tower is in the city of", " Paris", contrast=" Rome", by="head",
                              remote=True)  # the recipe travels with the request and runs server side
print(heads)  # the self-check ran on the client: the parts sum to the server's own logit difference
print(heads.top(5))
plots.show(plots.heads_heatmap(heads))
