# Title: A logit difference over a small dataset
# Eight landmark prompts, each attributed (right city minus a wrong one) per block: each component's mean and interval.
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
data = [  # one dict a row: the prompt, the right city, a wrong one
    {"prompt": "The Eiffel Tower is in the city of", "right": " Paris", "wrong": " Rome"},
    {"prompt": "The Colosseum is in the city of", "right": " Rome", "wrong": " Paris"},
    {"prompt": "Big Ben is in the city of", "right": " London", "wrong": " Berlin"},
    {"prompt": "The Brandenburg Gate is in the city of", "right": " Berlin", "wrong": " London"},
    {"prompt": "The Acropolis is in the city of", "right": " Athens", "wrong": " Madrid"},
    {"prompt": "The Prado Museum is in the city of", "right": " Madrid", "wrong": " Athens"},
    {"prompt": "The Kremlin is in the city of", "right": " Moscow", "wrong": " Tokyo"},
    {"prompt": "Tokyo Tower is in the city of", "right": " Tokyo", "wrong": " Moscow"},
]
stats = dla_recipes.attribute_dataset(model, data, target="right", contrast="wrong", reduce="stats")
summary = stats.summary()  # a row a component (then constant, logit): n, mean, std, sem, t and bootstrap intervals, ...
print(f"{stats}: mean logit difference {summary.loc['logit', 'mean']:.2f} "
      f"(std {summary.loc['logit', 'std']:.2f}), largest error {stats.error:.1e}")
display(stats.top(8)[["mean", "std", "ci_low", "ci_high", "share_positive"]].round(3))  # the largest means
plots.show(plots.stats_bars(stats, k=20))  # mean ± 95% t interval
