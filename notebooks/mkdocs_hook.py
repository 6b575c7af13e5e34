"""MkDocs hook: put the executed notebooks (build/notebooks/), their downloads and plotly.js into the site's files.

The pages of the site are the notebooks in notebooks/ and the recipe gallery (``gallery.ipynb``, assembled from the
executed docs/recipes/*.py), rendered by mkdocs-jupyter from their executed copies (``python notebooks/execute.py``
writes them; mkdocs never executes anything). A missing copy is an error; a copy made from other notebook, recipe
or package sources is a warning, so ``mkdocs build --strict`` fails rather than publish numbers the current code
did not produce. ``DLA_DOCS_NOTEBOOKS`` points at another folder of executed copies.

``DLA_DOCS_PARTIAL=1`` (what ``make docs`` sets) builds what has run instead: a page whose notebook has not run is
its code without outputs under a "Not run yet" note, a stale copy is published under an "Outputs from older sources"
note (both written to ``docs-pending/`` beside the executed copies), and the build lists them (info, not a
warning: ``--strict`` still fails on anything else).

Downloads: every notebook page gets a link under its title to ``notebooks/NAME.ipynb`` (the notebook without
outputs), and each recipe is offered as ``recipes/NAME.py`` (copied from docs/) and ``recipes/NAME.ipynb`` (one
cell). A link to a ``.ipynb`` or ``.py`` that is not in the site, or a table-of-contents entry whose anchor is not on
its page, is a warning (an error under ``--strict``).

plotly.min.js is served from the installed plotly package (no CDN: the site works offline). The family table page
(``family-table.md``) is generated from ``dla_recipes/families/`` by ``notebooks/families_table.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import posixpath
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.dla_recipes")
PLOTLY_JS = "assets/javascripts/plotly.min.js"
DOWNLOADS = "notebooks"  # site folder of the pages' .ipynb downloads


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
    import nbformat

    runner = _runner()
    out_dir = Path(os.environ.get("DLA_DOCS_NOTEBOOKS") or runner.OUT_DIR)
    partial = os.environ.get("DLA_DOCS_PARTIAL", "").strip().lower() in ("1", "true", "yes", "on")
    pending_dir = out_dir.parent / "docs-pending"  # build/docs-pending beside build/notebooks
    pages = [(source, runner.is_fresh(source, out_dir)) for source in runner.notebooks()]
    pages.append((runner.gallery_path(out_dir), runner.gallery_is_fresh(out_dir)))
    pending = []
    for source, fresh in pages:
        executed = runner.executed_path(source, out_dir)
        page_dir = out_dir
        what = "recipes (docs/recipes/*.py)" if executed.stem == runner.GALLERY else source.name
        if not executed.is_file() and not partial:
            raise PluginError(
                f"{executed.name} has no executed copy in {out_dir}: run `python notebooks/execute.py` first "
                "(`make docs` does both, and builds the pages that have run)"
            )
        if not fresh and partial:  # publish it as what it is: not run, or run from older sources
            why = "stale" if executed.is_file() else "missing"
            pending_dir.mkdir(parents=True, exist_ok=True)
            nbformat.write(runner.pending_page(source, out_dir, why=why), pending_dir / executed.name)
            page_dir = pending_dir
            pending.append(f"{executed.stem} ({'not run' if why == 'missing' else 'older sources'})")
        elif not fresh:
            log.warning(
                f"{executed} was not executed from the current {what} and dla_recipes sources: "
                "re-run `python notebooks/execute.py`"
            )
        executed = Path(page_dir) / executed.name
        files.append(File(executed.name, src_dir=str(page_dir), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
        # the download: the notebook without outputs (in-memory content: mkdocs-jupyter leaves it a plain file)
        clean = runner.clean_copy(nbformat.read(executed, as_version=4))
        files.append(File.generated(config, f"{DOWNLOADS}/{executed.name}", content=nbformat.writes(clean) + "\n"))
    for path in runner.recipes():  # the .py files are in docs/recipes/ already; add each as a one-cell notebook
        files.append(File.generated(config, f"recipes/{path.stem}.ipynb",
                                    content=nbformat.writes(runner.recipe_notebook(path)) + "\n"))
    if pending:
        log.info("pages built from what has run; not current (marked on the page): " + ", ".join(pending))
    files.append(File.generated(config, "family-table.md", content=_families_table().render()))
    try:
        import plotly
    except ImportError as error:
        raise PluginError("the docs need plotly (pip install 'dla_recipes[docs]')") from error
    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    files.append(File.generated(config, PLOTLY_JS, abs_src_path=str(plotly_js)))
    return files


def on_page_content(html: str, page, config, files: Files) -> str:
    """On a notebook page: the download link under the title; check its downloads, links and TOC anchors."""
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    download = files.get_file_from_path(f"{DOWNLOADS}/{Path(page.file.src_uri).name}")
    if download is None:
        raise PluginError(f"{page.file.src_uri}: no download copy {DOWNLOADS}/{Path(page.file.src_uri).name}")
    link = (f'<p class="dla-download"><a href="{download.url_relative_to(page.file)}" download>'
            f"Download this page as a notebook (.ipynb)</a></p>")
    title_end = html.find("</h1>")
    html = html[: title_end + 5] + link + html[title_end + 5:] if title_end >= 0 else link + html
    _check_links(html, page, files)
    _check_toc(html, page)
    return html


def _check_links(html: str, page, files: Files) -> None:
    """Warn about a relative link to a .ipynb or .py that the site does not have."""
    have = {f.dest_uri for f in files}
    base = posixpath.dirname(page.file.dest_uri)
    for href in re.findall(r'href="([^"#?:]+\.(?:ipynb|py))"', html):
        target = posixpath.normpath(posixpath.join(base, href))
        if target not in have:
            log.warning(f"{page.file.src_uri}: the link {href!r} points at {target}, which is not in the site")


def _check_toc(html: str, page) -> None:
    """Warn about a table-of-contents entry whose anchor no element of the page carries."""
    ids = set(re.findall(r'\sid="([^"]+)"', html))

    def walk(items):
        for item in items:
            anchor = item.url.split("#", 1)[-1] if "#" in item.url else ""
            if anchor and anchor not in ids:
                log.warning(f"{page.file.src_uri}: table-of-contents entry {item.title!r} links to #{anchor}, "
                            "which is not on the page")
            walk(item.children)

    walk(page.toc or [])
