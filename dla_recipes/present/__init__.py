"""The presentation stage: what a researcher reads. ``Attribution`` (the result and its views) and ``plots``.

It imports nothing of the package but the ``Component`` record (``dla_recipes.components``): it reads results.
"""
