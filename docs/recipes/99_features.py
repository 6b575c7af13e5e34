# Title: Features: SAE latents
# Block 24's MLP split into the latents of an SAE trained here (1024 latents, 8k tokens of news text), plus its error.
import dla_recipes
from dla_recipes import models
from dla_recipes.testing.dictionaries import cached_sae

model = dla_recipes.load(models.default_model_path(), dispatch=True)
sae = cached_sae(model, "smollm2-instruct", layer=24).dictionary  # or any sae-lens SAE / Transcoder as it is
attr = dla_recipes.attribute(model, "The Eiffel Tower is in the city of", " Paris", contrast=" Rome",
                             by="head", dictionaries={"L24.mlp": sae})
error = float(attr.values[0, list(attr.labels).index("L24.mlp.error")])
print(f"logit difference {float(attr.logit[0]):+.3f} (parts sum to it, error {attr.error:.1e}); "
      f"the SAE's error part {error:+.3f}")
attr.top(8, kind="feature")
