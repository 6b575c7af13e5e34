"""An ``Attribution`` as a small dataset, and its plots in a script: rows, means, kinds, a short repr, a file.

``attr[i]`` / slices / masks select prompts (every per-prompt field and diagnostic follows, and each row's logit is
still the model's own: a plain transformers forward of that prompt alone); ``top(prompt=None)`` and the figures'
``prompt=None`` average over the prompts; ``top(kind=...)`` keeps one kind of component; ``repr`` stays one short
line for 60 prompts; ``save`` / ``load`` are the package's own (not nnsight's ``.save()``); ``plots.show`` in a
script writes an HTML page and says where.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, plain_logits, tiny_model, tolerance

import dla_recipes
from dla_recipes import Attribution, InputError, plots
from dla_recipes.testing import tiny

TARGET_ID = 20  # the tiny tokenizer's "w20"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def heads(model):
    return dla_recipes.attribute(model, PROMPTS, TARGET, by="head")


def _model_logit(model, prompt: str) -> float:
    return float(plain_logits(model, prompt)[-1, TARGET_ID])


# -- rows ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mamba"])  # mamba: padding-unsafe, rows put back in the user's order
def test_a_row_is_one_prompts_attribution(family):
    model = tiny_model(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, by="head" if family == "llama" else "block")
    for i, prompt in enumerate(PROMPTS):
        for row in (attr[i], attr[i - len(PROMPTS)], attr[np.int64(i)], attr[torch.tensor(i)]):
            assert row.values.shape == (1, len(attr.labels)) and len(row) == 1
            assert row.prompts == (prompt,) and row.target_tokens == (TARGET,) and row.positions == attr.positions[i:i + 1]
            assert torch.equal(row.values, attr.values[i:i + 1]) and row.labels == attr.labels
            # the row's logit is the model's own for that prompt alone, and its parts sum to it
            expected = torch.tensor([_model_logit(model, prompt)])
            assert torch.allclose(row.logit, expected, atol=float(tolerance(expected)), rtol=0), (row.logit, expected)
            gap = (row.values.sum(-1) + row.constant - expected).abs()
            assert bool((gap <= tolerance(expected)).all()), gap
            assert row.error == pytest.approx(float((row.total - row.logit).abs().max()), abs=0)
            for key, value in attr.diagnostics.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == len(PROMPTS):
                    assert torch.equal(row.diagnostics[key], value[i:i + 1]), key
                else:
                    assert row.diagnostics[key] == value, key  # whole-call scalars stay
    assert [r.prompts for r in attr] == [(p,) for p in PROMPTS]  # iteration: one row at a time


def test_slices_lists_and_masks_select_rows_in_that_order(heads):
    for rows, index in ((slice(1, None), [1, 2]), ([2, 0], [2, 0]), (torch.tensor([True, False, True]), [0, 2]),
                        (np.array([1]), [1]), (slice(None, None, -1), [2, 1, 0])):
        part = heads[rows]
        assert part.prompts == tuple(PROMPTS[i] for i in index)
        assert torch.equal(part.values, heads.values[index]) and torch.equal(part.logit, heads.logit[index])
        assert torch.equal(part.diagnostics["bound"], heads.diagnostics["bound"][index])
        assert part.error <= heads.error
    with pytest.raises(IndexError, match=r"prompt 3 is outside this attribution of 3 prompts"):
        heads[3]
    with pytest.raises(IndexError, match=r"a mask of 2 bools for an attribution of 3 prompts"):
        heads[[True, False]]
    with pytest.raises(TypeError, match=r"index rows \(prompts\) with an int.*attr\.labels\.index\(label\)"):
        heads["L0.H1"]


# -- top: a mean over the prompts, one kind of component ------------------------------------------------------------


def test_top_of_no_prompt_is_the_mean_over_the_prompts(heads):
    top = heads.top(5, prompt=None)
    mean = heads.values.mean(0)
    expected = [heads.labels[j] for j in torch.argsort(mean.abs(), descending=True)[:5].tolist()]
    assert top["component"].tolist() == expected
    for label, value, share in zip(top["component"], top["value"], top["share"]):
        assert value == pytest.approx(float(mean[heads.labels.index(label)]), abs=1e-7)
        assert share == pytest.approx(value / float(heads.logit.mean()), rel=1e-6)


def test_top_of_one_kind(model, heads):
    is_head = [bool(re.fullmatch(r"L\d+\.H\d+", label)) for label in heads.labels]
    for kind, keep in (("head", is_head), ("block", [not h for h in is_head])):
        top = heads.top(4, prompt=1, kind=kind)
        columns = [j for j, k in enumerate(keep) if k]
        row = heads.values[1, columns]
        expected = [heads.labels[columns[j]] for j in torch.argsort(row.abs(), descending=True)[:4].tolist()]
        assert top["component"].tolist() == expected, kind
    assert len(heads.top(1000, kind="head")) == sum(is_head)
    blocks = dla_recipes.attribute(model, PROMPTS, TARGET)
    with pytest.raises(InputError, match=r"this attribution \(by='block'\) has no head components: attribute with "
                                         r"by='head'"):
        blocks.top(kind="head")
    with pytest.raises(InputError, match=r"kind='heads': use one of 'block', 'head', 'source', 'neuron', 'expert', "
                                         r"'shared', 'edit', 'feature', or None for all"):
        heads.top(kind="heads")


# -- repr --------------------------------------------------------------------------------------------------------------


def test_repr_is_one_short_line_however_many_prompts(model):
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(60)]
    attr = dla_recipes.attribute(model, prompts, [f"w{i}" for i in range(60)], contrast=CONTRAST, by="head")
    text = repr(attr)
    assert "\n" not in text and len(text) < 240, (len(text), text)
    assert "60 prompts x" in text and "target 60 tokens ('w0', 'w1', 'w2', ...) - 'w21'" in text
    assert re.search(r"logit mean -?\d.*\(min -?\d.*, max -?\d.*\)", text), text
    one = repr(attr[7])
    assert "1 prompt x" in one and "prompt 'w7 w8 w9'" in one and "target 'w7' - 'w21'" in one, one
    assert len(one) < 240


# -- save / load: the package's own, beside nnsight's .save() ---------------------------------------------------------


@pytest.mark.parametrize("by", ["block", "head", "neuron", "source"])
def test_save_then_load_gives_an_equal_attribution(model, tmp_path, by):
    if by == "source":  # it reads the attention pattern: eager attention
        model = tiny.standardized("llama", attn_implementation="eager")
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by)
    path = attr.save(tmp_path / "runs" / f"{by}.pt")
    loaded = Attribution.load(path)
    assert loaded == attr and loaded is not attr
    assert type(loaded.components) is type(attr.components) and loaded.components == attr.components
    for name in ("values", "constant", "logit", "output_logit"):
        assert torch.equal(getattr(loaded, name), getattr(attr, name)), name
    assert loaded.prompts == attr.prompts and loaded.labels == attr.labels and loaded.error == attr.error
    # plain data only: readable without unpickling code
    state = torch.load(path, weights_only=True)
    assert state["format"] == "dla_recipes.Attribution"
    assert loaded.top(3).equals(attr.top(3)) and loaded[1] == attr[1]


def test_save_of_a_direction_and_of_a_hand_built_attribution(model, tmp_path):
    direction = dla_recipes.attribute_direction(model, PROMPTS, torch.ones(64), layer=1)
    assert Attribution.load(direction.save(tmp_path / "direction.pt")) == direction
    hand = Attribution(values=torch.ones(2, 3), labels=["embed", "L0.attn", "L0.mlp"], constant=torch.zeros(2),
                       logit=torch.full((2,), 3.0), output_logit=torch.full((2,), 3.0), error=0.0)
    assert Attribution.load(hand.save(tmp_path / "hand.pt")) == hand
    assert hand != Attribution.load(direction.save(tmp_path / "again.pt"))
    (tmp_path / "other.pt").write_bytes(b"")
    torch.save({"values": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(InputError, match=r"not a saved dla_recipes Attribution"):
        Attribution.load(tmp_path / "other.pt")


def test_save_outside_a_trace_needs_a_path_and_nnsight_save_still_works(model, heads):
    import nnsight

    with pytest.raises(TypeError, match=r"Attribution\.save\(path\) writes the attribution to a file: give a path"):
        heads.save()
    with model.trace(PROMPTS[0]):
        kept = heads.save()  # nnsight's idiom inside a trace: marks it, as nnsight.save(heads) would
        hidden = nnsight.save(model.layers_output[0])
        logits = model.logits.save()  # nnsight's .save() on any other object is untouched
    assert kept is heads and hidden.shape[0] == 1
    assert float(logits.detach()[0, -1, TARGET_ID]) == pytest.approx(_model_logit(model, PROMPTS[0]), abs=1e-4)


# -- plots: a mean over prompts, and show in a script ------------------------------------------------------------------


def test_figures_of_no_prompt_show_the_mean(heads):
    pytest.importorskip("plotly")
    grid = heads.grid("H").mean(0)
    fig = plots.heads_heatmap(heads, prompt=None)
    z = torch.tensor([[float("nan") if v is None else v for v in row] for row in fig.data[0].z])
    assert torch.allclose(z, grid, atol=1e-6, equal_nan=True)
    assert "mean logit('w20') over 3 prompts" in fig.layout.title.text
    bars = plots.top_bar(heads, k=5, prompt=None, kind="head")
    assert list(bars.data[0].y) == heads.top(5, prompt=None, kind="head")["component"].tolist()
    assert "mean" in plots.blocks_bar(heads, prompt=None).layout.title.text
    pytest.importorskip("jinja2")
    table = plots.top_table(heads, k=4, prompt=None).to_html()
    assert "mean logit(&#x27;w20&#x27;) over 3 prompts" in table or "mean logit('w20') over 3 prompts" in table


def test_show_in_a_script_writes_an_html_page_and_says_where(heads, tmp_path, monkeypatch, capsys):
    pytest.importorskip("plotly")
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    fig = plots.heads_heatmap(heads)
    shown = plots.show(fig, static=False)
    err = capsys.readouterr().err
    assert shown.path is not None and shown.path.parent == tmp_path / "dla_recipes_plots"
    assert err == f"plots.show: no notebook to draw in, so the figure is written to {shown.path} (open it in a browser)\n"
    page = shown.path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "cdn.plot.ly/plotly-" in page and shown.div_id in page
    assert '"type":"heatmap"' in page.replace(" ", "")
    chosen = plots.show(fig, path=tmp_path / "figures" / "heads.html", static=False)
    assert chosen.path == tmp_path / "figures" / "heads.html" and chosen.path.exists()
    assert capsys.readouterr().err == ""  # a chosen path: written, nothing printed


def test_show_in_a_notebook_writes_nothing(heads, tmp_path, monkeypatch, capsys):
    pytest.importorskip("plotly")
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr("dla_recipes.present.display.in_notebook", lambda: True)
    shown = plots.show(plots.heads_heatmap(heads), static=False)
    assert shown.path is None and not (tmp_path / "dla_recipes_plots").exists() and capsys.readouterr().err == ""
    assert "application/vnd.plotly.v1+json" in shown._repr_mimebundle_()
