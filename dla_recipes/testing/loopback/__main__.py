"""The loopback NDIF server process: ``python -m dla_recipes.testing.loopback ...``, or ``python -P <this file> ...``.

``LoopbackServer`` runs this file by path (``protocol.SERVER_SCRIPT``), and ``main`` starts over from it when run with
``-m`` (which has imported ``dla_recipes`` already): run by path, it loads this folder as the top-level package
``loopback`` (its modules import the standard library and each other, relatively, at import time), so the server
process imports nothing of ``dla_recipes`` -- a real NDIF server has neither the project nor, necessarily, nnterp.
``-P`` keeps this folder off ``sys.path``, so that its modules are only reachable as ``loopback.*``.
"""

import importlib.util
import sys
from pathlib import Path

if __package__:  # python -m dla_recipes.testing.loopback
    from .main import main
else:  # python -P .../loopback/__main__.py: the package under the name "loopback", nothing of dla_recipes imported
    folder = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location(
        "loopback", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["loopback"] = package
    spec.loader.exec_module(package)
    from loopback.main import main

if __name__ == "__main__":
    main()
