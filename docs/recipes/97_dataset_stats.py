# Title: IOI heads over a dataset: mean ± interval, and clean vs corrupted
# 60 name-swapped IOI prompts on SmolLM2 by head, reduced to statistics in the trace; then the paired difference.
import pandas as pd
from IPython.display import display

import dla_recipes
from dla_recipes import models, plots

model = dla_recipes.load(models.default_model_path())
templates = ["When {A} and {B} went to the {place}, {S2} gave a {thing} to",
             "After {A} and {B} arrived at the {place}, {S2} handed a {thing} to",
             "While {A} and {B} were walking to the {place}, {S2} passed a {thing} to"]
pairs = [("Mary", "John"), ("Tom", "James"), ("Sarah", "Anna"), ("Paul", "Kate"), ("David", "Emma"),
         ("Peter", "Lucy"), ("Mary", "Tom"), ("John", "Sarah"), ("Anna", "Paul"), ("Kate", "Peter")]
rows = []
for t, template in enumerate(templates):
    for p, (a, b) in enumerate(pairs):
        c = ["Lisa", "Mark", "Ruth"][p % 3]  # a third name: the corrupted prompt's second subject
        where = {"place": ["store", "park", "beach"][(t + p) % 3], "thing": ["drink", "book", "ball"][(t + 2 * p) % 3]}
        for io, s in ((a, b), (b, a)):  # each pair of names in both orders
            rows.append({"prompt": template.format(A=io, B=s, S2=s, **where), "io": " " + io, "s": " " + s,
                         "corrupted": template.format(A=io, B=s, S2=c, **where)})
data = pd.DataFrame(rows)

# per head: mean, std, sem, t interval, bootstrap interval, share positive, sign-flip p (reduced in the trace)
stats = dla_recipes.attribute_dataset(model, data, target="io", contrast="s", by="head", reduce="stats",
                                      progress=False)
print(stats, f"mean logit difference {stats.summary().loc['logit', 'mean']:.3f}, largest error {stats.error:.1e}")
display(stats.top(8).round(3))

# clean - corrupted (S2 replaced by a third name), prompt by prompt, both prompts of a row in one batch
paired = dla_recipes.attribute_dataset(model, data, target="io", contrast="s", by="head", reduce="stats",
                                       compare="corrupted", progress=False)
print(paired, f"mean difference of the logit difference {paired.summary().loc['logit', 'mean']:.3f}")
display(paired.top(8)[["mean", "ci_low", "ci_high", "share_positive", "p_signflip"]].round(3))
plots.show(plots.stats_bars(stats, k=15, interval="bootstrap"))  # the clean means, 95% bootstrap intervals
