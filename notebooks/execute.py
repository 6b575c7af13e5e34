"""Execute the docs notebooks (notebooks/*.ipynb) and the gallery recipes (docs/recipes/*.py) with nbclient.

    python notebooks/execute.py                 # every notebook into build/notebooks/, every recipe, the gallery page
    python notebooks/execute.py --reuse         # skip notebooks and recipes whose executed copy is up to date
    python notebooks/execute.py quickstart      # only these notebooks (file stems); `gallery` for the recipes

The sources in notebooks/ are kept without outputs; the executed copies go to ``build/notebooks/`` (git-ignored),
each stamped with a fingerprint (sha256 of the notebook and of the dla_recipes sources) and its execution time in
``metadata.dla_recipes``. ``mkdocs build`` renders those copies (``notebooks/mkdocs_hook.py``) and warns (an error
under ``--strict``) when one is missing or does not match the current sources, so every number and plot on the
site comes from running the current code. The tests load this file as the module ``dla_docs_notebooks`` and share
its in-process record, so one pytest run executes each notebook once.

The kernel runs this interpreter (its folder is put first on PATH), with OMP_NUM_THREADS=2 unless set, offline
Hugging Face settings, and without NDIF_API_KEY unless ``--ndif`` is given (with a key, the remote notebook runs
against NDIF itself instead of the loopback server). The real models are fetched (and converted, once) here, before
any kernel starts, so no download log lands in a page.

The recipe gallery: each ``docs/recipes/NN_name.py`` is one notebook cell (first line ``# Title: ...``, second line
``# what it shows``) that runs alone in a fresh kernel. Each runs as a one-cell notebook in its own kernel, executed
into ``build/recipes/`` with its time (``build/recipes/timings.json``); the page ``gallery.ipynb`` (in
``build/notebooks/``) is then assembled from those executed cells. A recipe that runs remotely (``remote=True``)
gets a loopback NDIF server and the environment a real NDIF user sets (``NDIF_HOST``, ``NDIF_API_KEY``, and
``NDIF_MODEL`` naming the served model), unless ``--ndif`` keeps a real key.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parent
ROOT = NOTEBOOK_DIR.parent
OUT_DIR = ROOT / "build" / "notebooks"
PACKAGE_DIR = ROOT / "dla_recipes"
MODULE_NAME = "dla_docs_notebooks"
CELL_TIMEOUT = 900  # seconds per cell
RECIPE_DIR = ROOT / "docs" / "recipes"
RECIPE_OUT_DIR = ROOT / "build" / "recipes"
GALLERY = "gallery"  # the gallery page: OUT_DIR / "gallery.ipynb", built from the executed recipes
LOOPBACK_MODEL = "SmolLM2-135M-Instruct"  # what the loopback server serves a remote recipe
# what the notebooks import, beyond the package and its stack (dla_recipes.testing.zygote.PRELOAD): imported once
# by the zygote each kernel is forked from (``execute_all``)
KERNEL_PRELOAD = ("transformers.models.gemma3.modeling_gemma3", "pandas", "plotly.graph_objects", "plotly.io",
                  "IPython", "ipykernel.kernelapp", "ipykernel.ipkernel")


@dataclass
class Result:
    """One notebook's execution: where the executed copy is, how long it took, and the error if it failed."""

    name: str
    seconds: float
    output: Path | None
    error: str | None = None
    reused: bool = False
    cpu_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


_DONE: dict[tuple[str, str], Result] = {}  # (source path, fingerprint) -> result, this process


def notebooks() -> list[Path]:
    """The source notebooks, in name order."""
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _sha256(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint(source: Path) -> dict:
    """What an executed copy must match to be current: the notebook's and the package's sources."""
    package = sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)
    return {"notebook_sha256": _sha256([source]), "package_sha256": _sha256(package)}


def executed_path(source: Path, out_dir: Path = OUT_DIR) -> Path:
    """Where the executed copy of a notebook or recipe goes (``NAME.ipynb`` in ``out_dir``)."""
    return Path(out_dir) / f"{Path(source).stem}.ipynb"


def stamp(executed: Path) -> dict | None:
    """The ``metadata.dla_recipes`` stamp of an executed copy (None if missing or unreadable)."""
    try:
        return json.loads(executed.read_text(encoding="utf-8"))["metadata"].get("dla_recipes")
    except (OSError, ValueError, KeyError):
        return None


def is_fresh(source: Path, out_dir: Path = OUT_DIR) -> bool:
    """Whether the executed copy exists and was made from the current notebook and package sources."""
    found = stamp(executed_path(source, out_dir))
    want = fingerprint(source)
    return bool(found) and all(found.get(k) == v for k, v in want.items())


_PREFETCHED = False


def prefetch_models() -> None:
    """Fetch and convert the real models the pages use, here, so their download logs never land in a cell."""
    global _PREFETCHED
    if _PREFETCHED:
        return
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from dla_recipes import models

    models.default_model_path()
    models.gemma3_270m_path()
    from dla_recipes.testing.dictionaries import lee_corpus

    lee_corpus()  # the Features page's training text (the SAE itself is trained, silently, by the page)
    _PREFETCHED = True


# --- the recipe gallery ------------------------------------------------------------------------------------------


@dataclass
class Recipe:
    """One gallery recipe: ``docs/recipes/NN_name.py``, its title and one-line summary (its first two lines)."""

    path: Path
    title: str
    summary: str
    code: str

    @property
    def name(self) -> str:
        return self.path.stem


def recipes() -> list[Path]:
    """The gallery recipes, ``docs/recipes/*.py``, in name order."""
    return sorted(RECIPE_DIR.glob("*.py"))


def read_recipe(path: Path) -> Recipe:
    """Parse a recipe; raise ValueError unless it starts ``# Title: ...`` then a ``# ...`` summary line."""
    code = Path(path).read_text(encoding="utf-8").rstrip("\n")
    lines = code.splitlines()
    title = re.fullmatch(r"# Title: (\S.*)", lines[0]) if lines else None
    summary = re.fullmatch(r"# (\S.*)", lines[1]) if len(lines) > 1 else None
    if not title or not summary:
        raise ValueError(f"{Path(path).name}: a recipe starts with '# Title: ...' and a second line '# what it shows'")
    return Recipe(Path(path), title.group(1).strip(), summary.group(1).strip(), code)


def recipe_notebook(path: Path):
    """The recipe as a notebook of one code cell, exactly the file's text (what a reader pastes into a cell)."""
    import nbformat

    recipe = read_recipe(path)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(recipe.code, id=re.sub(r"[^A-Za-z0-9-]", "-", recipe.name))]
    nb.metadata.update({"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                        "language_info": {"name": "python"}})
    return nb


def needs_ndif(path: Path) -> bool:
    """Whether a recipe runs remotely (its code says ``remote=True``)."""
    return "remote=True" in Path(path).read_text(encoding="utf-8")


@contextlib.contextmanager
def _recipe_env(path: Path, keep_ndif_key: bool = False):
    """Extra kernel environment for one recipe: for a remote recipe, a loopback NDIF server and its host and key.

    The recipe reads what a real NDIF user sets: ``NDIF_API_KEY`` and ``NDIF_HOST`` (which nnsight reads at
    import) and ``NDIF_MODEL`` (the model to load). The loopback server serves the default model's folder under a
    name; an IPython startup file maps that folder to the name in nnsight's model-key cache, the one step a hub
    lookup does for a real model id (``dla_recipes.testing.loopback.register_model_key``). With ``--ndif`` and
    a key in the environment, nothing is started: the recipe runs on NDIF itself.
    """
    if not needs_ndif(path) or (keep_ndif_key and os.environ.get("NDIF_API_KEY")):
        yield {}
        return
    from dla_recipes import models
    from dla_recipes.testing.loopback import LoopbackServer

    folder = str(models.default_model_path())
    with tempfile.TemporaryDirectory(prefix="dla-ipython-") as ipython_dir, \
            LoopbackServer({LOOPBACK_MODEL: folder}, api_key=secrets.token_hex(16)) as server:
        startup = Path(ipython_dir, "profile_default", "startup")
        startup.mkdir(parents=True)
        (startup / "00-loopback-ndif.py").write_text(
            "from dla_recipes.testing.loopback import register_model_key\n"
            f"register_model_key({folder!r}, {LOOPBACK_MODEL!r})\n"
        )
        yield {"NDIF_HOST": server.url, "NDIF_API_KEY": server.api_key, "NDIF_MODEL": folder,
               "IPYTHONDIR": ipython_dir}


def gallery_fingerprint() -> dict:
    """What the gallery page must match to be current: every recipe's source and the package's."""
    package = sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)
    return {"recipes_sha256": _sha256(recipes()), "package_sha256": _sha256(package)}


def gallery_path(out_dir: Path = OUT_DIR) -> Path:
    return Path(out_dir) / f"{GALLERY}.ipynb"


def gallery_is_fresh(out_dir: Path = OUT_DIR) -> bool:
    """Whether the gallery page exists, was built from the current recipes and package, and every recipe ran."""
    found = stamp(gallery_path(out_dir))
    return (bool(found) and all(found.get(k) == v for k, v in gallery_fingerprint().items())
            and not found.get("not_run"))


def execute_recipes(*, reuse: bool = False, keep_ndif_key: bool = False, log=print,
                    out_dir: Path = RECIPE_OUT_DIR, zygote=None) -> list[Result]:
    """Run every recipe alone, each in a fresh kernel; write ``timings.json`` beside the executed copies."""
    results = []
    for path in recipes():
        result = execute(path, out_dir, reuse=reuse, keep_ndif_key=keep_ndif_key, zygote=zygote)
        status = "reused" if result.reused else ("ok" if result.ok else "FAILED")
        cpu = f"(kernel CPU {result.cpu_seconds:.1f} s)" if result.cpu_seconds is not None else ""
        log(f"{'recipe ' + result.name:<36} {result.seconds:7.1f} s  {status} {cpu}")
        results.append(result)
    total = write_timings(results, out_dir, key="recipes")
    log(f"{'recipes total':<28} {total:7.1f} s  (each alone in a fresh kernel)")
    return results


def clean_copy(nb):
    """A notebook without outputs, execution counts or the execution stamp: what a reader downloads."""
    import copy

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("dla_recipes", None)
    return nb


def build_gallery(results: list[Result], out_dir: Path = OUT_DIR, partial: bool = False) -> Path:
    """Assemble the gallery page from the executed recipes: per recipe a heading, its links and time, its cell.

    A recipe that failed or did not run is an error, unless ``partial``: then its cell is its code without outputs
    under a "not run" note, and the page's stamp lists it (``not_run``), so it is never taken for a current page."""
    import nbformat

    by_name = {r.name: r for r in results if r.ok}
    chosen = [read_recipe(path) for path in recipes()]
    not_run = [recipe.name for recipe in chosen if recipe.name not in by_name]
    if not_run and not partial:
        raise RuntimeError(f"recipes failed or not executed, so the gallery cannot be built: {', '.join(not_run)}")

    def took(result: Result | None) -> str:
        if result is None:
            return "not run"
        cpu = f" ({result.cpu_seconds:.0f} s CPU)" if result.cpu_seconds is not None else ""
        return f"{result.seconds:.0f} s{cpu}"

    rows = "\n".join(f"| [{r.title}](#{_anchor(r.title)}) | {r.summary} | {took(by_name.get(r.name))} |"
                     for r in chosen)
    cells = [nbformat.v4.new_markdown_cell(
        "# Recipe gallery\n\n"
        "Each recipe is **one cell** that runs alone in a fresh Jupyter kernel: imports, model, prompts, result and "
        "plot. Paste it into a notebook, or download it (`.py` or a one-cell `.ipynb`). CI runs every recipe this "
        "way, each in its own fresh kernel (`tests/test_gallery.py`); the outputs below come from that run, and the "
        "time is the whole run of the cell in its new kernel, imports and model loading included (wall clock, and the "
        "kernel's CPU time, which does not depend on what else the machine was running).\n\n"
        "| recipe | what it shows | time |\n|---|---|---|\n" + rows, id="gallery-intro")]
    for recipe in chosen:
        result = by_name.get(recipe.name)
        links = (f"[`{recipe.name}.py`](../recipes/{recipe.name}.py) · "
                 f"[`{recipe.name}.ipynb`](../recipes/{recipe.name}.ipynb)")
        ran = (f"Ran alone in a fresh kernel in {took(result)}" if result is not None
               else f"Not run: `python notebooks/execute.py {GALLERY}` runs it")
        cells.append(nbformat.v4.new_markdown_cell(
            f"## {recipe.title}\n\n{recipe.summary}\n\n"
            f'<span class="dla-recipe-meta">{ran} · download</span> {links}', id=f"{recipe.name}-about"))
        cells.append(nbformat.read(result.output, as_version=4).cells[0] if result is not None
                     else recipe_notebook(recipe.path).cells[0])
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata.update({"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                        "language_info": {"name": "python"},
                        "dla_recipes": {**gallery_fingerprint(), "seconds": round(sum(r.seconds for r in results), 2),
                                        "recipes": {r.name: {"seconds": round(by_name[r.name].seconds, 2),
                                                             "cpu_seconds": by_name[r.name].cpu_seconds}
                                                    for r in chosen if r.name in by_name},
                                        "not_run": not_run}})
    target = gallery_path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return target


def _anchor(title: str) -> str:
    """The id mkdocs-jupyter gives a heading (lower case, words joined by '-', punctuation dropped)."""
    import unicodedata

    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def kernel_env(keep_ndif_key: bool = False) -> dict:
    """The environment the kernel runs in (see the module docstring)."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env.update({
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "MPLBACKEND": "Agg",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        # tqdm.auto's "IProgress not found" (no ipywidgets in a headless kernel): cosmetic, kept off the pages
        "PYTHONWARNINGS": "ignore:IProgress not found",
    })
    if not keep_ndif_key:
        env.pop("NDIF_API_KEY", None)
    return env


def _kernel_manager(sockets: str, zygote, env: dict):
    """A kernel manager on IPC sockets in ``sockets``: a kernel forked from ``zygote`` (``dla_recipes.testing.zygote``)
    when one is given and fits ``env`` (``Zygote.fits``), else an ordinary ``ipykernel``."""
    from jupyter_client.manager import KernelManager

    # IPC sockets in a private folder, rather than TCP ports on 127.0.0.1 (which the kernel warns about)
    km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "kernel"))
    if zygote is not None and zygote.fits(env):
        pid_file = str(Path(sockets) / "kernel.pid")
        km.format_kernel_cmd = lambda extra_arguments=None: zygote.command("kernel", ["-f", km.connection_file],
                                                                           pid_file)
        km.dla_pid_file = pid_file
    return km


def execute(source: Path, out_dir: Path = OUT_DIR, *, reuse: bool = False, keep_ndif_key: bool = False,
            zygote=None) -> Result:
    """Execute one notebook into ``out_dir`` (once per process for the same sources; ``reuse``: also across runs),
    in a kernel forked from ``zygote`` where its environment allows (``execute_all``)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    source, out_dir = Path(source).resolve(), Path(out_dir)
    wanted = fingerprint(source)
    key = (str(source), json.dumps(wanted, sort_keys=True) + str(out_dir.resolve()))
    if key in _DONE and (reuse or not _DONE[key].reused):  # executed in this process (or reuse allowed)
        return _DONE[key]
    target = executed_path(source, out_dir)
    if reuse and is_fresh(source, out_dir):
        found = stamp(target)
        result = Result(source.stem, float(found.get("seconds", 0.0)), target, reused=True,
                        cpu_seconds=found.get("cpu_seconds"))
        _DONE[key] = result
        return result
    out_dir.mkdir(parents=True, exist_ok=True)
    prefetch_models()
    failed = target.with_suffix(".failed.ipynb")
    for stale in (target, failed):
        stale.unlink(missing_ok=True)
    is_recipe = source.suffix == ".py"
    nb = recipe_notebook(source) if is_recipe else nbformat.read(source, as_version=4)
    sockets = tempfile.TemporaryDirectory(prefix="dla-kernel-")
    start = time.perf_counter()
    error, km = None, None
    try:
        with _recipe_env(source, keep_ndif_key) if is_recipe else contextlib.nullcontext({}) as extra:
            env = {**kernel_env(keep_ndif_key), **extra}
            km = _kernel_manager(sockets.name, zygote, env)
            client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=False,
                                    resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
            start = time.perf_counter()  # the recipe's own time, not the loopback server's start
            client.execute(env=env)
    except CellExecutionError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a kernel that died or timed out: report it as the notebook's failure
        error = f"{type(exc).__name__}: {exc}"
    finally:
        seconds = time.perf_counter() - start
        cpu_seconds = _kernel_cpu_seconds(km)
        # nbclient leaves a kernel it did not create running: stop it (it holds a model)
        if km is not None and km.has_kernel:
            km.shutdown_kernel(now=True)
        sockets.cleanup()
    nb.metadata["dla_recipes"] = {**wanted, "seconds": round(seconds, 2), "cpu_seconds": cpu_seconds,
                                  "python": sys.version.split()[0]}
    if error is None:
        nbformat.write(nb, target)
        result = Result(source.stem, seconds, target, cpu_seconds=cpu_seconds)
    else:
        nbformat.write(nb, failed)
        result = Result(source.stem, seconds, failed, error=error, cpu_seconds=cpu_seconds)
    _DONE[key] = result
    return result


def _kernel_cpu_seconds(km) -> float | None:
    """CPU seconds the kernel process used (user + system): the run's cost whatever else shares the machine."""
    process = getattr(getattr(km, "provisioner", None), "process", None)
    try:
        import psutil

        pid_file = getattr(km, "dla_pid_file", None)  # a forked kernel: the launcher wrote the kernel's pid
        pid = int(Path(pid_file).read_text()) if pid_file else process.pid
        times = psutil.Process(pid).cpu_times()
        return round(times.user + times.system + times.children_user + times.children_system, 2)
    except Exception:  # noqa: BLE001 - no psutil, or the kernel already gone: not measured
        return None


def execute_all(out_dir: Path = OUT_DIR, *, names=None, reuse: bool = False, keep_ndif_key: bool = False,
                log=print, forked: bool = True) -> list[Result]:
    """Execute every notebook (or those whose stem is in ``names``) and, unless ``names`` leaves it out, every
    recipe and the gallery page; write ``timings.json`` beside the copies. Returns the notebooks' and recipes' results.
    ``forked``: each kernel is forked from one process that has imported the libraries (``dla_recipes.testing.zygote``;
    started only if something runs), else each is a plain ``ipykernel``.
    """
    from dla_recipes.testing.zygote import PRELOAD, Zygote

    zygote = (Zygote(sys.executable, kernel_env(keep_ndif_key), PRELOAD + KERNEL_PRELOAD) if forked
              else contextlib.nullcontext())
    with zygote:
        return _execute_all(out_dir, names, reuse, keep_ndif_key, log, zygote if forked else None)


def _execute_all(out_dir: Path, names, reuse: bool, keep_ndif_key: bool, log, zygote) -> list[Result]:
    have = [p.stem for p in notebooks()] + [GALLERY]
    chosen = [p for p in notebooks() if not names or p.stem in names]
    if names and set(names) - set(have):
        missing = sorted(set(names) - set(have))
        raise SystemExit(f"no such notebook(s): {', '.join(missing)} (have: {', '.join(have)})")
    results = []
    for source in chosen:
        result = execute(source, out_dir, reuse=reuse, keep_ndif_key=keep_ndif_key, zygote=zygote)
        status = "reused" if result.reused else ("ok" if result.ok else "FAILED")
        log(f"{result.name:<28} {result.seconds:7.1f} s  {status}")
        results.append(result)
    total = write_timings(results, out_dir)
    log(f"{'total':<28} {total:7.1f} s  (reused copies count the time they took)")
    if not names or GALLERY in names:
        recipe_results = execute_recipes(reuse=reuse, keep_ndif_key=keep_ndif_key, log=log, zygote=zygote)
        failed = [r.name for r in recipe_results if not r.ok]
        page = build_gallery(recipe_results, out_dir, partial=True)  # what ran; a failed recipe shows as not run
        log(f"gallery page: {page}" + (f" (not run: {', '.join(failed)})" if failed else ""))
        results += recipe_results
    return results


PENDING_NOTE = {  # (title, text) of the note on a page that is not current; HTML: notebook markdown has no admonitions
    "missing": ("Not run yet",
                ("This page has not been executed: it shows the notebook's code without its outputs. Run "
                 "<code>python notebooks/execute.py {name}</code> (or <code>make docs</code>) to fill it in.")),
    "stale": ("Outputs from older sources",
              ("This page's outputs were computed from an earlier version of the notebook or of dla_recipes. Run "
               "<code>python notebooks/execute.py {name}</code> (or <code>make docs</code>) to bring them up to "
               "date.")),
}


def pending_page(source: Path, out_dir: Path = OUT_DIR, *, why: str = "missing"):
    """A page to publish for a notebook (or the gallery) that has not run against the current sources, for a docs
    build of what has run (``make docs``): its executed copy under a note (``why="stale"``), or (``"missing"``) its
    code without outputs (the gallery: every recipe's code). A strict build refuses both instead."""
    import nbformat

    source = Path(source)
    name = source.stem
    if why == "stale":
        nb = nbformat.read(executed_path(source, out_dir), as_version=4)
    elif name == GALLERY:
        nb = build_gallery_placeholder()
    else:
        nb = clean_copy(nbformat.read(source, as_version=4))
    title, text = PENDING_NOTE[why]
    note = nbformat.v4.new_markdown_cell(
        f'<div class="admonition warning dla-pending"><p class="admonition-title">{title}</p>'
        f"<p>{text.format(name=name)}</p></div>", id="dla-pending")
    first = 1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0  # after the page's title
    nb.cells.insert(first, note)
    nb.metadata.pop("dla_recipes", None)
    return nb


def build_gallery_placeholder():
    """The gallery page before any recipe ran: a heading per recipe and its code, without outputs."""
    import nbformat

    cells = [nbformat.v4.new_markdown_cell("# Recipe gallery", id="gallery-intro")]
    for path in recipes():
        recipe = read_recipe(path)
        cells.append(nbformat.v4.new_markdown_cell(f"## {recipe.title}\n\n{recipe.summary}", id=f"{recipe.name}-about"))
        cells.append(recipe_notebook(path).cells[0])
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata.update({"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                        "language_info": {"name": "python"}})
    return nb


def write_timings(results: list[Result], out_dir: Path = OUT_DIR, key: str = "notebooks") -> float:
    """Write ``timings.json`` (seconds per notebook or recipe; reused copies keep the time they took); return the
    total."""
    total = sum(r.seconds for r in results)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    timings = {r.name: {"seconds": round(r.seconds, 2), "cpu_seconds": r.cpu_seconds, "ok": r.ok, "reused": r.reused}
               for r in results}
    (Path(out_dir) / "timings.json").write_text(
        json.dumps({key: timings, "total_seconds": round(total, 2)}, indent=2) + "\n")
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook file stems, or gallery (default: all)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"output folder (default: {OUT_DIR.relative_to(ROOT)})")
    parser.add_argument("--reuse", action="store_true", help="skip notebooks whose executed copy is up to date")
    parser.add_argument("--ndif", action="store_true", help="keep NDIF_API_KEY: the remote notebook then runs on NDIF")
    parser.add_argument("--plain-kernels", action="store_true",
                        help="start each kernel as a plain ipykernel, not forked from one (dla_recipes.testing.zygote)")
    args = parser.parse_args(argv)
    results = execute_all(args.out, names=args.names, reuse=args.reuse, keep_ndif_key=args.ndif,
                          forked=not args.plain_kernels)
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"\n{result.name} failed (partial output: {result.output}):\n{result.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.modules.setdefault(MODULE_NAME, sys.modules[__name__])
    sys.exit(main())
