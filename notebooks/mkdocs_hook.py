"""MkDocs hook: put the executed notebooks (build/notebooks/) and plotly.js into the site's files.

The pages of the site are the notebooks in notebooks/, rendered by mkdocs-jupyter from their executed copies
(``python notebooks/execute.py`` writes them; mkdocs never executes anything). A missing copy is an error; a copy
made from other notebook or package sources is a warning, so ``mkdocs build --strict`` fails rather than publish
numbers the current code did not produce. ``DLA_DOCS_NOTEBOOKS`` points at another folder of executed copies.

plotly.min.js is served from the installed plotly package (no CDN: the site works offline). The family table page
(``family-table.md``) is generated from ``dla_recipes/families.py`` by ``notebooks/families_table.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.dla_recipes")
PLOTLY_JS = "assets/javascripts/plotly.min.js"


def _families_table():
    """notebooks/families_table.py, as a module."""
    here = Path(__file__).resolve().parent / "families_table.py"
    spec = importlib.util.spec_from_file_location("dla_docs_families_table", here)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runner():
    """notebooks/execute.py, as the module the tests share (``dla_docs_notebooks``)."""
    here = Path(__file__).resolve().parent / "execute.py"
    module = sys.modules.get("dla_docs_notebooks")
    if module is None:
        spec = importlib.util.spec_from_file_location("dla_docs_notebooks", here)
        module = importlib.util.module_from_spec(spec)
        sys.modules["dla_docs_notebooks"] = module
        spec.loader.exec_module(module)
    return module


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns .ipynb files into pages
def on_files(files: Files, config) -> Files:
    runner = _runner()
    out_dir = Path(os.environ.get("DLA_DOCS_NOTEBOOKS") or runner.OUT_DIR)
    for source in runner.notebooks():
        executed = runner.executed_path(source, out_dir)
        if not executed.is_file():
            raise PluginError(
                f"{source.name} has no executed copy in {out_dir}: run `python notebooks/execute.py` first "
                "(`make docs` does both)"
            )
        if not runner.is_fresh(source, out_dir):
            log.warning(
                f"{executed} was not executed from the current {source.name} and dla_recipes sources: "
                "re-run `python notebooks/execute.py`"
            )
        files.append(File(source.name, src_dir=str(out_dir), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    files.append(File.generated(config, "family-table.md", content=_families_table().render()))
    try:
        import plotly
    except ImportError as error:
        raise PluginError("the docs need plotly (pip install 'dla_recipes[docs]')") from error
    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    files.append(File.generated(config, PLOTLY_JS, abs_src_path=str(plotly_js)))
    return files
