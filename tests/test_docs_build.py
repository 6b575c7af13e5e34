"""Building the docs from what has run: ``make docs`` in an active environment, and pages whose notebook has not run.

``make docs`` uses the active environment (``VIRTUAL_ENV`` or ``CONDA_PREFIX``) rather than insisting on building
its own ``.venv`` (checked with ``make -n``: nothing runs). ``DLA_DOCS_PARTIAL=1`` (what ``make docs`` sets) builds
the site, under ``mkdocs build --strict``, when some notebooks have no executed copy (their code under a "Not run
yet" note) or a stale one (under an "Outputs from older sources" note); without it the build refuses, as before. A
gallery whose recipes did not all run is built from those that did, and is never taken for a current page.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import notebook_runner

ROOT = Path(__file__).resolve().parents[1]
RUNNER = notebook_runner()


def _dry_run(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "DOCS_PYTHON")}
    out = subprocess.run(["make", "-n", "docs"], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("variable", ["VIRTUAL_ENV", "CONDA_PREFIX"])
def test_make_docs_uses_the_active_environment(variable, tmp_path):
    env = str(tmp_path / "env")
    commands = _dry_run(**{variable: env})
    assert f"{env}/bin/python notebooks/execute.py --reuse" in commands
    assert f"DLA_DOCS_PARTIAL=1 {env}/bin/python -m mkdocs build --strict" in commands
    assert "-m venv" not in commands and "pip" not in commands.replace("pip install -e", ""), commands
    fresh = str(tmp_path / "fresh-venv")  # a project venv that does not exist yet (the checkout's may well exist)
    assert f"-m venv {fresh}" in _dry_run(VENV=fresh), "without an active environment it builds the project's venv first"


def _fake_executed(source: Path, out_dir: Path, fresh: bool = True) -> None:
    """An 'executed' copy of ``source`` without outputs, stamped current (or stale)."""
    import nbformat

    nb = nbformat.read(source, as_version=4)
    nb.metadata["dla_recipes"] = RUNNER.fingerprint(source) if fresh else {"notebook_sha256": "old"}
    nbformat.write(nb, RUNNER.executed_path(source, out_dir))


@pytest.mark.slow  # two mkdocs builds of the site, each a fresh interpreter
def test_the_docs_build_what_has_run(tmp_path):
    """One notebook current, one stale, the others and the gallery never run: the partial build succeeds under
    --strict and marks each page for what it is; the strict build refuses the missing copies."""
    out_dir = tmp_path / "notebooks"
    out_dir.mkdir()
    _fake_executed(RUNNER.NOTEBOOK_DIR / "quickstart.ipynb", out_dir)
    _fake_executed(RUNNER.NOTEBOOK_DIR / "which-token.ipynb", out_dir, fresh=False)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DLA_DOCS_NOTEBOOKS=str(out_dir))

    def build(partial: bool, site: Path):
        return subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
            cwd=ROOT, env={**env, "DLA_DOCS_PARTIAL": "1" if partial else ""}, capture_output=True, text=True,
            timeout=600, check=False)

    strict = build(False, tmp_path / "strict")
    assert strict.returncode != 0 and "has no executed copy" in strict.stdout + strict.stderr
    partial = build(True, tmp_path / "site")
    log = partial.stdout + partial.stderr
    assert partial.returncode == 0, log
    assert not [line for line in log.splitlines() if re.match(r"^(WARNING|ERROR)\b", line)], log
    page = {name: (tmp_path / "site" / name / "index.html").read_text(encoding="utf-8")
            for name in ("quickstart", "which-token", "ablate-patch-steer", "gallery")}
    assert "Not run yet" not in page["quickstart"] and "Outputs from older sources" not in page["quickstart"]
    assert "Outputs from older sources" in page["which-token"] and "notebooks/execute.py which-token" in page["which-token"]
    assert "Not run yet" in page["ablate-patch-steer"] and "head_slice" in page["ablate-patch-steer"]  # its code
    assert "Not run yet" in page["gallery"] and "Ablate, then attribute" in page["gallery"]
    assert "not run" in log and "ablate-patch-steer (not run)" in log and "which-token (older sources)" in log


def test_a_gallery_of_what_ran(tmp_path):
    """A failed recipe: the gallery is built from the others, the failed one's code shown as not run, and the page is
    not current (a strict build would refuse it); without ``partial`` building it is refused, as before."""
    import nbformat

    recipes = RUNNER.recipes()
    results = []
    for i, path in enumerate(recipes):
        executed = tmp_path / f"{path.stem}.ipynb"
        nbformat.write(RUNNER.recipe_notebook(path), executed)
        results.append(RUNNER.Result(path.stem, 1.0, executed, error="boom" if i == 0 else None))
    with pytest.raises(RuntimeError, match=recipes[0].stem):
        RUNNER.build_gallery(results, tmp_path)
    page = nbformat.read(RUNNER.build_gallery(results, tmp_path, partial=True), as_version=4)
    text = "\n".join(cell.source for cell in page.cells)
    assert f"execute.py {RUNNER.GALLERY}" in text and text.count("Not run") == 1
    assert page.metadata["dla_recipes"]["not_run"] == [recipes[0].stem]
    assert not RUNNER.gallery_is_fresh(tmp_path)
    page = nbformat.read(RUNNER.build_gallery([r for r in results if r.ok] + [
        RUNNER.Result(recipes[0].stem, 1.0, tmp_path / f"{recipes[0].stem}.ipynb")], tmp_path), as_version=4)
    assert RUNNER.gallery_is_fresh(tmp_path) and "Not run" not in "\n".join(c.source for c in page.cells)
