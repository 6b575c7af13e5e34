"""The presentation stage: what a researcher reads. ``Attribution`` (the result and its views; ``storage``: its
file), ``PositionAttribution`` (``positions``: several positions a prompt, over a flat ``Attribution``), ``plots``
(its figures; ``position_plots``: a prompt's positions; ``display``: showing them in a notebook, the docs or a
script).

It imports nothing of the package but the ground (``dla_recipes.components``, ``dla_recipes.errors``): it reads
results.
"""
