"""Every docs notebook (notebooks/*.ipynb) executes without an error, on the default model and the tiny models.

Each notebook runs in a fresh kernel with nbclient (``notebooks/execute.py``, the same runner the docs build uses),
and its executed copy is written to ``build/notebooks/``, where ``mkdocs build`` renders it from. In one pytest run
each notebook executes once: ``test_docs_site.py`` shares the runner's in-process record. The measured times are
printed and written to ``build/notebooks/timings.json`` (reported, not asserted: time is measured by benchmarks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import notebook_runner

ROOT = Path(__file__).resolve().parents[1]


RUNNER = notebook_runner()
NOTEBOOKS = RUNNER.notebooks()


def test_there_are_notebooks():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "how-it-works", "heads-and-neurons", "families", "remote", "attribute-direction",
            "ablate-patch-steer", "every-position", "a-dataset", "why-the-head-attended", "features"} <= names


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.notebooks
@pytest.mark.real
def test_notebook_executes(source):
    import nbformat

    result = RUNNER.execute(source)
    print(f"{result.name}: {result.seconds:.1f} s -> {result.output}")
    assert result.ok, f"{source.name} failed (partial output in {result.output}):\n{result.error}"
    nb = nbformat.read(result.output, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code), "a code cell did not run"
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors, errors
    assert RUNNER.is_fresh(source), "the executed copy is not stamped with the current sources"


def test_source_notebooks_carry_no_outputs():
    """The sources stay clean: outputs live only in the executed copies (build/notebooks/, git-ignored)."""
    import nbformat

    for source in NOTEBOOKS:
        nb = nbformat.read(source, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{source.name} has stored outputs"


@pytest.mark.notebooks
@pytest.mark.real
def test_record_execution_times():
    """Reports (does not assert) how long the notebooks took: time is measured, not tested."""
    results = [RUNNER.execute(source) for source in NOTEBOOKS]  # executed above in this process: the recorded results
    total = RUNNER.write_timings(results)
    print("notebook times: " + ", ".join(f"{r.name} {r.seconds:.1f} s" for r in results) + f"; total {total:.1f} s "
          f"({RUNNER.OUT_DIR / 'timings.json'})")
    assert all(r.ok for r in results)
