"""The presentation stage: what a researcher reads. ``Attribution`` (the result and its views; ``storage``: its
file), ``plots`` (its figures; ``display``: showing them in a notebook, the docs or a script).

It imports nothing of the package but the ground (``dla_recipes.components``, ``dla_recipes.errors``): it reads
results.
"""
