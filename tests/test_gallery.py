"""The recipe gallery: every ``docs/recipes/*.py`` runs alone in a fresh Jupyter kernel, and the page is built from it.

Each recipe is one notebook cell (imports, model, prompts, result, plot) that must run with nothing before it: the
runner (``notebooks/execute.py``, the one the docs build uses) executes each as a one-cell notebook in its own new
kernel, with nbclient, and records its time in ``build/recipes/timings.json`` (reported, not asserted). A remote
recipe runs against a loopback NDIF server, reading its host and key from the environment as on NDIF. The recipes
are collected from the folder, so a new file is picked up without editing this test. In one pytest run each recipe
executes once: ``test_docs_site.py`` shares the runner's in-process record.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import bounds
import pytest
from conftest import notebook_runner

import dla_recipes

ROOT = Path(__file__).resolve().parents[1]
RUNNER = notebook_runner()
RECIPES = RUNNER.recipes()
# each recipe executed in a fresh kernel: they load the default model, a remote one starts a loopback NDIF server
EXECUTED = [pytest.param(p, id=p.stem, marks=[pytest.mark.server] if RUNNER.needs_ndif(p) else []) for p in RECIPES]


def test_the_gallery_has_its_recipes():
    names = {p.stem for p in RECIPES}
    assert {"10_per_block", "20_head_heatmap", "30_top_neurons", "40_dataset_logit_difference", "70_remote_ndif",
            "80_direction", "90_seed_recipe_by_hand", "95_every_position",
            "97_dataset_stats", "98_why_the_head_attended"} <= names, sorted(names)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_header_and_syntax(path):
    """``NN_name.py``, first line ``# Title: ...``, second line a comment saying what it shows; valid Python."""
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.py", path.name), path.name
    recipe = RUNNER.read_recipe(path)
    assert recipe.title and recipe.summary
    compile(recipe.code, str(path), "exec")


def test_read_recipe_refuses_a_file_without_its_header(tmp_path):
    bad = tmp_path / "55_no_header.py"
    bad.write_text("import dla_recipes\n")
    with pytest.raises(ValueError, match="# Title:"):
        RUNNER.read_recipe(bad)


def test_readme_first_example_is_the_first_recipe():
    """The README's first Python example and ``docs/recipes/10_per_block.py`` are the same code, byte for byte."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```python\n(.*?)```", readme, re.DOTALL)
    assert first, "README.md has no ```python example"
    assert RECIPES[0].name == "10_per_block.py", "the gallery's first recipe is 10_per_block.py"
    assert first.group(1) == RECIPES[0].read_text(encoding="utf-8")


@pytest.mark.parametrize("path", EXECUTED)
@pytest.mark.notebooks
@pytest.mark.real
def test_recipe_runs_alone_in_a_fresh_kernel(path):
    import nbformat

    result = RUNNER.execute(path, RUNNER.RECIPE_OUT_DIR)
    print(f"{result.name}: {result.seconds:.1f} s alone in a fresh kernel -> {result.output}")
    assert result.ok, f"{path.name} failed (partial output in {result.output}):\n{result.error}"
    nb = nbformat.read(result.output, as_version=4)
    assert len(nb.cells) == 1 and nb.cells[0].source == RUNNER.read_recipe(path).code, "the cell is the file"
    cell = nb.cells[0]
    assert cell.execution_count == 1, "the recipe did not run first in its kernel"
    assert not [o for o in cell.outputs if o.output_type == "error"]
    assert cell.outputs, f"{path.name} shows nothing"
    stderr = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stderr")
    assert "[dla_recipes]" not in stderr, f"model download logs in the output:\n{stderr}"
    assert RUNNER.is_fresh(path, RUNNER.RECIPE_OUT_DIR)


@pytest.mark.notebooks
@pytest.mark.real
@pytest.mark.server
def test_remote_recipe_ran_on_the_loopback_server():
    """The remote recipe's model had no weights on the client, and its run went through a server (its env)."""
    path = RUNNER.RECIPE_DIR / "70_remote_ndif.py"
    assert RUNNER.needs_ndif(path)
    result = RUNNER.execute(path, RUNNER.RECIPE_OUT_DIR)
    assert result.ok, result.error
    import nbformat

    text = "".join(o.get("text", "") for o in nbformat.read(result.output, as_version=4).cells[0].outputs)
    assert "Attribution(llama, by='head'" in text, text


@pytest.mark.notebooks
@pytest.mark.real
@pytest.mark.server  # executes every recipe, the remote one included (reused when already executed)
def test_gallery_page_and_times():
    """The page has every recipe's code and outputs, its download links and time; timings.json has every recipe."""
    import json

    import nbformat

    results = RUNNER.execute_recipes(reuse=True, log=lambda line: print(f"[recipes] {line}"))
    assert all(r.ok for r in results), [f"{r.name}: {r.error}" for r in results if not r.ok]
    page = nbformat.read(RUNNER.build_gallery(results), as_version=4)
    assert RUNNER.gallery_is_fresh()
    text = "\n".join(cell.source for cell in page.cells)
    code = [cell for cell in page.cells if cell.cell_type == "code"]
    assert len(code) == len(RECIPES) and all(cell.outputs for cell in code)
    for path, cell in zip(RECIPES, code):
        recipe = RUNNER.read_recipe(path)
        assert cell.source == recipe.code
        assert f"## {recipe.title}" in text and f"../recipes/{path.stem}.py" in text
        assert f"../recipes/{path.stem}.ipynb" in text
    timings = json.loads((RUNNER.RECIPE_OUT_DIR / "timings.json").read_text())["recipes"]
    assert set(timings) == {p.stem for p in RECIPES} and all(t["ok"] for t in timings.values())
    print("recipe times (each alone in a fresh kernel): "
          + ", ".join(f"{r.name} {r.seconds:.1f} s" for r in results) + f"; total {sum(r.seconds for r in results):.1f} s")


@pytest.mark.slow  # a fresh interpreter: its imports alone take ~7 s of CPU
def test_plots_without_plotly_says_how_to_install():
    """``dla_recipes.plots`` without plotly raises an ImportError naming the extra, not a bare ModuleNotFoundError."""
    code = (
        "import sys\n"
        "import torch\n"
        "from dla_recipes import Attribution, plots\n"
        "class Block:  # as if plotly and jinja2 were not installed (imported lazily, after this point)\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('plotly', 'jinja2'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "for name in [m for m in sys.modules if m.split('.')[0] in ('plotly', 'jinja2')]:\n"
        "    del sys.modules[name]\n"
        "sys.meta_path.insert(0, Block())\n"
        "attr = Attribution(values=torch.ones(1, 2), labels=['embed', 'L0.attn'], constant=torch.zeros(1),\n"
        "                   logit=torch.full((1,), 2.0), output_logit=torch.full((1,), 2.0), error=0.0)\n"
        "for draw in (plots.blocks_bar, plots.top_table):\n"
        "    try:\n"
        "        draw(attr)\n"
        "    except ImportError as error:\n"
        "        print(type(error).__name__, error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("ImportError") and 'dla_recipes[plots]' in line for line in lines), lines


# -- the editing recipes, on both real models ------------------------------------------------------------------------

REAL_MODELS = ["smollm2-135m", "gemma3-270m"]  # Gemma-3-270M's heads are 256 wide, hidden_size // heads is 160
_LOADED: dict = {}


def run_recipe_on(name: str, stem: str, monkeypatch, folder: Path, edit=lambda code: code) -> dict:
    """Run recipe ``stem`` in this process on real model ``name`` (``models.default_model_path`` pointed at it, the
    model loaded once per session); ``edit`` may change the code first (run from a file in ``folder``: nnsight reads
    a trace's source back). Returns the recipe's namespace."""
    import runpy

    from dla_recipes import models

    path, load = models.REGISTRY[name](), dla_recipes.load

    def load_once(model, **kwargs):
        if str(model) not in _LOADED:
            _LOADED[str(model)] = load(model, **kwargs)
        return _LOADED[str(model)]

    monkeypatch.setattr(models, "default_model_path", lambda: path)
    monkeypatch.setattr(dla_recipes, "load", load_once)
    script = folder / f"{stem}.py"
    script.write_text(edit(RUNNER.read_recipe(RUNNER.RECIPE_DIR / f"{stem}.py").code), encoding="utf-8")
    return runpy.run_path(str(script), run_name=f"recipe_{stem}")


def part(attr, row: int, label: str) -> float:
    return float(attr.values[row, attr.labels.index(label)])


@pytest.mark.parametrize("name", REAL_MODELS)
@pytest.mark.real
@pytest.mark.slow  # a recipe on each real model (each loaded once per session: SmolLM2 ~5 s of CPU, Gemma-3 ~10 s)
def test_ablate_recipe_zeroes_the_head_on_real_models(name, monkeypatch, tmp_path):
    """Recipe 50's ablated heads write exactly nothing on both real models (it asserts so for each of its 5 heads)."""
    ns = run_recipe_on(name, "50_ablate_then_attribute", monkeypatch, tmp_path)
    assert len(ns["heads"]) == 5 and len(ns["total"]) == 5
    assert part(ns["edited"], 0, ns["label"]) == 0.0 != part(ns["clean"], 0, ns["label"])


@pytest.mark.parametrize("name", REAL_MODELS)
@pytest.mark.real
@pytest.mark.slow  # a recipe on each real model (each loaded once per session: SmolLM2 ~5 s of CPU, Gemma-3 ~10 s)
def test_patch_recipe_patches_exactly_the_head_on_real_models(name, monkeypatch, tmp_path):
    """Recipe 60 with the patched value zeroed: the head's part at the patched position is exactly 0, so the recipe's
    slice is the whole head and nothing else of it is left."""
    line = "heads_in[:, -1][hs.index] = from_corrupted"

    def zero_patch(code):
        assert code.count(line) == 1, "recipe 60's patch line changed: update this test"
        return code.replace(line, line.replace("= from_corrupted", "= 0 * from_corrupted"))

    ns = run_recipe_on(name, "60_patch_then_attribute", monkeypatch, tmp_path, zero_patch)
    label = f"L{ns['layer']}.H{ns['head']}"
    assert part(ns["patched"], 1, label) == 0.0 != part(ns["unpatched"], 0, label)


@pytest.mark.parametrize("name", REAL_MODELS)
@pytest.mark.real
@pytest.mark.slow  # a recipe on each real model (each loaded once per session: SmolLM2 ~5 s of CPU, Gemma-3 ~10 s)
def test_every_position_recipe_matches_a_plain_forward_on_real_models(name, monkeypatch, tmp_path):
    """Recipe 95's parts at every position sum to the next token's logit of a plain transformers forward of the
    sentence (the model's own logits, no nnsight), on both real models (Gemma-3 starts with <bos>)."""
    import torch

    ns = run_recipe_on(name, "95_every_position", monkeypatch, tmp_path)
    attr, model = ns["attr"], ns["model"]
    ids = model.tokenizer(ns["sentence"])["input_ids"]
    with torch.no_grad():
        logits = model._module(torch.tensor([ids])).logits[0].float()
    plain = logits[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # [n_tokens - 1]
    assert attr.values.shape[:2] == (1, len(ids) - 1) and bool(attr.mask.all())
    gap = (attr.values[0].sum(-1) + attr.constant[0] - plain).abs()
    # both forwards' rounding of each next-token logit (bounds.logit_rounding), capped by the float32 promise (on
    # these models the worst case is above it: 576- and 640-term dots), plus this float32 sum of the parts
    # (measured before: 1.1e-5 at most, logits 8..37)
    rounding = bounds.logit_rounding(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    promise = 1e-4 * plain.double().abs().clamp(min=1.0)
    limit = torch.minimum(2 * rounding, promise) + bounds.sum_bound(attr.values[0])
    assert float((gap / limit).max()) <= 1, gap.max()
    assert ns["k"] == len(ids) - 3 and attr.target_tokens[0][ns["k"]] == " Paris"
