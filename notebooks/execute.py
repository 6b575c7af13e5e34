"""Execute the docs notebooks (notebooks/*.ipynb) with nbclient and store the executed copies for the site.

    python notebooks/execute.py                 # execute every notebook into build/notebooks/ (fails on any error)
    python notebooks/execute.py --reuse         # skip notebooks whose executed copy is up to date
    python notebooks/execute.py quickstart      # only these notebooks (file stems)

The sources in notebooks/ are kept without outputs; the executed copies go to ``build/notebooks/`` (git-ignored),
each stamped with a fingerprint (sha256 of the notebook and of the dla_recipes sources) and its execution time in
``metadata.dla_recipes``. ``mkdocs build`` renders those copies (``notebooks/mkdocs_hook.py``) and warns (an error
under ``--strict``) when one is missing or does not match the current sources, so every number and plot on the
site comes from running the current code. The tests load this file as the module ``dla_docs_notebooks`` and share
its in-process record, so one pytest run executes each notebook once.

The kernel runs this interpreter (its folder is put first on PATH), with OMP_NUM_THREADS=2 unless set, offline
Hugging Face settings, and without NDIF_API_KEY unless ``--ndif`` is given (with a key, the remote notebook runs
against NDIF itself instead of the loopback server).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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


@dataclass
class Result:
    """One notebook's execution: where the executed copy is, how long it took, and the error if it failed."""

    name: str
    seconds: float
    output: Path | None
    error: str | None = None
    reused: bool = False

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
    return Path(out_dir) / source.name


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


def execute(source: Path, out_dir: Path = OUT_DIR, *, reuse: bool = False, keep_ndif_key: bool = False) -> Result:
    """Execute one notebook into ``out_dir`` (once per process for the same sources; ``reuse``: also across runs)."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    source, out_dir = Path(source).resolve(), Path(out_dir)
    wanted = fingerprint(source)
    key = (str(source), json.dumps(wanted, sort_keys=True) + str(out_dir.resolve()))
    if key in _DONE and (reuse or not _DONE[key].reused):  # executed in this process (or reuse allowed)
        return _DONE[key]
    target = executed_path(source, out_dir)
    if reuse and is_fresh(source, out_dir):
        result = Result(source.stem, float(stamp(target).get("seconds", 0.0)), target, reused=True)
        _DONE[key] = result
        return result
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = target.with_suffix(".failed.ipynb")
    for stale in (target, failed):
        stale.unlink(missing_ok=True)
    nb = nbformat.read(source, as_version=4)
    sockets = tempfile.TemporaryDirectory(prefix="dla-kernel-")
    # IPC sockets in a private folder, rather than TCP ports on 127.0.0.1 (which the kernel warns about)
    km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets.name) / "kernel"))
    client = NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    start = time.perf_counter()
    error = None
    try:
        client.execute(env=kernel_env(keep_ndif_key))
    except CellExecutionError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a kernel that died or timed out: report it as the notebook's failure
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sockets.cleanup()
    seconds = time.perf_counter() - start
    nb.metadata["dla_recipes"] = {**wanted, "seconds": round(seconds, 2), "python": sys.version.split()[0]}
    if error is None:
        nbformat.write(nb, target)
        result = Result(source.stem, seconds, target)
    else:
        nbformat.write(nb, failed)
        result = Result(source.stem, seconds, failed, error=error)
    _DONE[key] = result
    return result


def execute_all(out_dir: Path = OUT_DIR, *, names=None, reuse: bool = False, keep_ndif_key: bool = False,
                log=print) -> list[Result]:
    """Execute every notebook (or those whose stem is in ``names``); write ``timings.json`` beside the copies."""
    chosen = [p for p in notebooks() if not names or p.stem in names]
    if names and len(chosen) != len(set(names)):
        missing = sorted(set(names) - {p.stem for p in chosen})
        raise SystemExit(f"no such notebook(s): {', '.join(missing)} (have: {', '.join(p.stem for p in notebooks())})")
    results = []
    for source in chosen:
        result = execute(source, out_dir, reuse=reuse, keep_ndif_key=keep_ndif_key)
        status = "reused" if result.reused else ("ok" if result.ok else "FAILED")
        log(f"{result.name:<28} {result.seconds:7.1f} s  {status}")
        results.append(result)
    total = write_timings(results, out_dir)
    log(f"{'total':<28} {total:7.1f} s  (reused copies count the time they took)")
    return results


def write_timings(results: list[Result], out_dir: Path = OUT_DIR) -> float:
    """Write ``timings.json`` (seconds per notebook; reused copies keep the time they took); return the total."""
    total = sum(r.seconds for r in results)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    timings = {r.name: {"seconds": round(r.seconds, 2), "ok": r.ok, "reused": r.reused} for r in results}
    (Path(out_dir) / "timings.json").write_text(
        json.dumps({"notebooks": timings, "total_seconds": round(total, 2)}, indent=2) + "\n")
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook file stems (default: all)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"output folder (default: {OUT_DIR.relative_to(ROOT)})")
    parser.add_argument("--reuse", action="store_true", help="skip notebooks whose executed copy is up to date")
    parser.add_argument("--ndif", action="store_true", help="keep NDIF_API_KEY: the remote notebook then runs on NDIF")
    args = parser.parse_args(argv)
    results = execute_all(args.out, names=args.names, reuse=args.reuse, keep_ndif_key=args.ndif)
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"\n{result.name} failed (partial output: {result.output}):\n{result.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.modules.setdefault(MODULE_NAME, sys.modules[__name__])
    sys.exit(main())
