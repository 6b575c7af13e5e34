"""``PositionAttribution``, the view of several positions a prompt, over sites assembled from one-position calls.

The core's multi-position ``attribute`` is not here yet, so each test builds the flat per-site ``Attribution`` the
way it will come: one ``attribute(..., position=p)`` call per column (the prompts that have that position), its rows
put prompt-major. Checked: the ``[batch, n_positions]`` layout (masked entries NaN, never another prompt's numbers;
each site's logit the model's own, a plain transformers forward of that prompt alone), ``at(k)`` is the column's
one-position call, ``sum()`` is the sum of each prompt's plain-forward logits, ``blocks()`` is ``by="block"``, the
long ``to_frame``, prompt selection, ``save`` / ``load``, a short ``repr`` and the two plots.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import PROMPTS, TARGET, plain_logits, tiny_model, tolerance
from test_positions import batch_bound, batch_ratio

import dla_recipes
from dla_recipes import Attribution, InputError, PositionAttribution, plots

TARGET_ID = 20  # the tiny tokenizer's "w20"
ALL = list(range(6))  # position="all" over PROMPTS: the longest has 6 tokens, the others 2 and 4 (masked past them)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def own_tokens(model, prompt: str) -> tuple[str, ...]:
    return tuple(model.tokenizer.decode([t]) for t in model.tokenizer(prompt)["input_ids"])


def concat(rows: list[Attribution]) -> Attribution:
    """One-row attributions stacked into one flat attribution (per-row diagnostics stacked, whole-call ones the
    largest: the calls differ in them)."""
    first = rows[0]
    diagnostics = {}
    for key, value in first.diagnostics.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 1:
            diagnostics[key] = torch.cat([r.diagnostics[key] for r in rows])
        else:
            diagnostics[key] = max(r.diagnostics[key] for r in rows)

    def stack(name):
        return torch.cat([getattr(r, name) for r in rows])

    def join(name):
        return tuple(x for r in rows for x in getattr(r, name))

    values, constant, logit = stack("values"), stack("constant"), stack("logit")
    return Attribution(values=values, labels=first.labels, constant=constant, logit=logit,
                       output_logit=stack("output_logit"), error=float((values.sum(-1) + constant - logit).abs().max()),
                       prompts=join("prompts"), target_tokens=join("target_tokens"), positions=join("positions"),
                       by=first.by, family=first.family, diagnostics=diagnostics, components=first.components,
                       dtype=first.dtype,
                       contrast_tokens=None if first.contrast_tokens is None else join("contrast_tokens"))


def assemble(model, columns, by="block", prompts=PROMPTS):
    """``(PositionAttribution, {column: its one-position Attribution}, {column: the prompts in it})``: one
    ``attribute`` call per column (``columns``: the position of each, as ``attribute`` takes it)."""
    calls, members = {}, {}
    for k, position in enumerate(columns):
        lengths = [len(own_tokens(model, p)) for p in prompts]
        members[k] = [b for b, n in enumerate(lengths) if -n <= position < n]
        if members[k]:
            calls[k] = dla_recipes.attribute(model, [prompts[b] for b in members[k]], TARGET, position=position, by=by)
    index = torch.full((len(prompts), len(columns)), -1, dtype=torch.long)
    rows = []
    for b in range(len(prompts)):
        for k in range(len(columns)):
            if b in members[k]:
                index[b, k] = len(rows)
                rows.append(calls[k][members[k].index(b)])
    sites = concat(rows)
    tokens = tuple(own_tokens(model, p) for p in prompts)
    return PositionAttribution(sites, index, tuple(prompts), tokens), calls, members


@pytest.fixture(scope="module")
def every(model):
    return assemble(model, ALL)


@pytest.fixture(scope="module")
def every_head(model):
    return assemble(model, ALL, by="head")[0]


def test_the_table_lays_each_prompts_sites_out_and_masks_the_rest(model, every):
    attr, calls, members = every
    lengths = [len(own_tokens(model, p)) for p in PROMPTS]
    assert lengths == [6, 2, 4] and len(attr) == 3 and attr.n_positions == 6
    expected_mask = torch.tensor([[k < n for k in ALL] for n in lengths])
    assert torch.equal(attr.mask, expected_mask)
    assert torch.equal(attr.positions, torch.where(expected_mask, torch.tensor(ALL), -1))
    values, logit = attr.values, attr.logit
    assert values.shape == (3, 6, len(attr.labels)) and logit.shape == attr.constant.shape == (3, 6)
    assert bool(values[~attr.mask].isnan().all()) and bool(logit[~attr.mask].isnan().all())
    assert bool(attr.output_logit[~attr.mask].isnan().all()) and bool(attr.total[~attr.mask].isnan().all())
    assert not bool(values[attr.mask].isnan().any()) and torch.equal(values[attr.mask], attr.sites.values)
    for b, prompt in enumerate(PROMPTS):
        own = plain_logits(model, prompt)[:, TARGET_ID]
        for k in range(lengths[b]):
            # the numbers at (b, k) are prompt b's own: its one-position call's row, its plain forward's logit
            assert torch.equal(values[b, k], calls[k].values[members[k].index(b)])
            assert abs(float(logit[b, k]) - float(own[k])) <= float(tolerance(own[k])), (b, k)
            assert abs(float(attr.total[b, k]) - float(own[k])) <= float(tolerance(own[k])), (b, k)
    assert attr.target_tokens == tuple(tuple(TARGET if m else "" for m in row) for row in expected_mask.tolist())
    assert attr.contrast_tokens is None
    bound = attr.diagnostics["bound"]
    assert bound.shape == (3, 6) and bool(bound[~attr.mask].isnan().all()) and bool((bound[attr.mask] > 0).all())
    assert attr.diagnostics["head_error"] == attr.sites.diagnostics["head_error"]  # a whole-call scalar, as is
    assert attr.error == attr.sites.error and attr.labels == attr.sites.labels and attr.by == "block"
    assert attr.family == "llama" and attr.dtype == "float32" and attr.components == attr.sites.components


def test_a_column_is_its_one_position_call(every):
    attr, calls, members = every
    for k in ALL:
        column = attr.at(k)
        call = calls[k]
        assert column.prompts == call.prompts == tuple(PROMPTS[b] for b in members[k])
        assert column.positions == call.positions and column.target_tokens == call.target_tokens
        for name in ("values", "constant", "logit", "output_logit"):
            assert torch.equal(getattr(column, name), getattr(call, name)), (k, name)
        for key in ("bound", "split_rounding", "scale"):
            assert torch.equal(column.diagnostics[key], call.diagnostics[key]), (k, key)
        assert column.labels == call.labels and column.error == call.error
    assert attr.at(-1) == attr.at(5) and attr.at(-6) == attr.at(0)
    with pytest.raises(IndexError, match=r"position column 6 is outside this attribution of 6 positions"):
        attr.at(6)


def test_the_sum_is_the_sum_of_each_prompts_own_logits(model, every):
    attr = every[0]
    total = attr.sum()
    assert isinstance(total, Attribution) and len(total) == 3 and total.prompts == tuple(PROMPTS)
    assert total.positions == ((0, 1, 2, 3, 4, 5), (0, 1), (0, 1, 2, 3))
    assert total.target_tokens == ("'w20' at 6 positions", "'w20' at 2 positions", "'w20' at 4 positions")
    assert total.values.dtype == torch.float32 and total.values.shape == (3, len(attr.labels))
    assert total.diagnostics["bound"].shape == (3,) and total.diagnostics["scale"].shape == (3, 6)
    gaps = []
    for b, prompt in enumerate(PROMPTS):
        own = plain_logits(model, prompt)[:, TARGET_ID].double()[: len(total.positions[b])]
        allowed = float(tolerance(own).sum())  # each site's promise, added up
        gaps.append(abs(float(total.values[b].double().sum() + total.constant[b].double()) - float(own.sum())))
        assert gaps[-1] <= allowed, (b, gaps[-1], allowed)
        assert abs(float(total.logit[b]) - float(own.sum())) <= allowed
    # the promise, site by site (2e-4 to 6e-4 here); measured: the parts' sums within 1.3e-7 of the plain forward's
    assert total.error == pytest.approx(float((total.total - total.logit).abs().max()), abs=0)
    assert "logit [" in repr(total) and "\n" not in repr(total)


def test_a_prompt_with_no_attributed_position_sums_to_zero(model):
    attr = assemble(model, [4, 5])[0]  # only the 6-token prompt has positions 4 and 5
    assert torch.equal(attr.mask, torch.tensor([[True, True], [False, False], [False, False]]))
    total = attr.sum()
    assert total.positions == ((4, 5), (), ()) and total.target_tokens[1] == "nothing at 0 positions"
    assert torch.equal(total.values[1:], torch.zeros(2, len(attr.labels))) and float(total.logit[1:].abs().max()) == 0
    own = plain_logits(model, PROMPTS[0])[4:6, TARGET_ID].double()
    assert abs(float(total.total[0]) - float(own.sum())) <= float(tolerance(own).sum())
    assert len(attr[1].sites) == 0 and attr[1].at(0).values.shape == (0, len(attr.labels))


def test_blocks_is_by_block(model, every, every_head):
    block = every[0]
    blocks = every_head.blocks()
    assert every_head.by == "head" and blocks.by == "block" and blocks.labels == block.labels
    assert torch.equal(blocks.mask, block.mask) and blocks.prompts == block.prompts
    assert torch.equal(blocks.values.isnan(), block.values.isnan())
    # heads summed into their blocks against by="block": both float32 reads of the site's stream, within their
    # rounding of its logit (test_positions.batch_bound; measured before: 4.5e-8)
    for k in range(block.n_positions):
        members = [b for b in range(len(PROMPTS)) if block.mask[b, k]]
        limit = batch_bound(model, [PROMPTS[b] for b in members], lambda b, p, z: z[p, TARGET_ID], [k] * len(members))
        assert batch_ratio(blocks.values[members, k], block.values[members, k], limit) <= 1


def test_to_frame_is_long(model, every):
    attr = every[0]
    frame = attr.to_frame()
    n_sites = int(attr.mask.sum())
    assert list(frame.columns) == ["prompt", "position", "token", "target", "component", "value"]
    assert len(frame) == n_sites * (len(attr.labels) + 2) == 12 * 9
    assert set(frame.component) == {*attr.labels, "constant", "logit"}
    assert frame.groupby("prompt").position.max().tolist() == [5, 1, 3]
    for (b, p), site in frame.groupby(["prompt", "position"]):
        assert set(site.token) == {own_tokens(model, PROMPTS[b])[p]} and set(site.target) == {TARGET}
        parts = site[site.component != "logit"].value.sum()
        assert parts == pytest.approx(float(site[site.component == "logit"].value.iloc[0]), abs=1e-6)
        assert site[site.component == "L0.attn"].value.iloc[0] == float(attr.values[b, p, attr.labels.index("L0.attn")])


def test_prompts_select_with_ints_slices_lists_and_masks(every):
    attr = every[0]
    for rows, chosen in ((1, [1]), (slice(1, None), [1, 2]), ([2, 0], [2, 0]), (np.int64(-1), [2]),
                         (torch.tensor([True, False, True]), [0, 2]), (slice(None, None, -1), [2, 1, 0])):
        part = attr[rows]
        assert isinstance(part, PositionAttribution) and len(part) == len(chosen)
        assert part.prompts == tuple(PROMPTS[b] for b in chosen)
        assert part.tokens == tuple(attr.tokens[b] for b in chosen)
        assert torch.equal(part.mask, attr.mask[chosen]) and torch.equal(part.positions, attr.positions[chosen])
        assert torch.allclose(part.values, attr.values[chosen], atol=0, rtol=0, equal_nan=True)
        assert torch.equal(part.sites.values, attr.values[chosen][attr.mask[chosen]])
        assert part.error <= attr.error and part.target_tokens == tuple(attr.target_tokens[b] for b in chosen)
    assert [p.prompts for p in attr] == [(p,) for p in PROMPTS]
    with pytest.raises(IndexError, match=r"prompt 3 is outside this attribution of 3 prompts"):
        attr[3]
    with pytest.raises(InputError, match=r"prompt-major"):
        PositionAttribution(attr.sites, attr.index.flip(0), attr.prompts, attr.tokens)


def test_top_reads_one_site(model):
    attr, calls, _ = assemble(model, [0, -1], by="head")  # the last position differs per prompt: 5, 1, 3
    assert torch.equal(attr.positions, torch.tensor([[0, 5], [0, 1], [0, 3]]))
    for b in range(3):
        assert attr.top(5, prompt=b).equals(calls[1].top(5, prompt=b))
        assert attr.top(3, prompt=b, position=0, kind="head").equals(calls[0].top(3, prompt=b, kind="head"))
    masked = assemble(model, ALL[:4])[0]
    assert masked.top(prompt=1).equals(masked.at(1).top(prompt=1))  # -1: prompt 1's own last attributed position
    with pytest.raises(IndexError, match=r"prompt 1 has no position in column 3"):
        masked.top(prompt=1, position=3)


def test_save_and_load_give_it_back_equal(every, tmp_path):
    attr = every[0]
    loaded = PositionAttribution.load(attr.save(tmp_path / "runs" / "every.pt"))
    assert loaded == attr and loaded is not attr and loaded.tokens == attr.tokens
    assert torch.allclose(loaded.values, attr.values, atol=0, rtol=0, equal_nan=True)
    assert loaded != attr[[0, 1]]
    total = attr.sum()
    back = Attribution.load(total.save(tmp_path / "sum.pt"))
    assert back == total and back.positions == total.positions and type(back.positions[0]) is tuple
    with pytest.raises(InputError, match=r"PositionAttribution\.load"):
        Attribution.load(tmp_path / "runs" / "every.pt")
    with pytest.raises(InputError, match=r"Attribution\.load"):
        PositionAttribution.load(tmp_path / "sum.pt")


def test_repr_is_one_short_line(every):
    attr = every[0]
    for shown in (attr, attr[[0, 1, 2] * 20], attr[1]):
        text = repr(shown)
        assert "\n" not in text and len(text) < 240, (len(text), text)
        assert text.startswith("PositionAttribution(llama, by='block', ") and "x 6 positions x 7 components" in text
    assert "60 prompts" in repr(attr[[0, 1, 2] * 20]) and "prompt 'w11 w12'" in repr(attr[1])
    assert "over 12 sites" in attr.error_summary() and "bound" in attr.error_summary()


def test_the_plots_show_one_prompts_positions(model, every, every_head):
    pytest.importorskip("plotly")
    attr = every_head
    blocks = every[0]
    for b in range(3):
        fig = plots.positions_heatmap(attr, prompt=b)
        n = int(attr.mask[b].sum())
        z = torch.tensor(fig.data[0].z, dtype=torch.float64)
        assert z.shape == (len(blocks.labels), n) and list(fig.data[0].y) == blocks.labels
        assert torch.allclose(z, blocks.values[b, :n].double().T, atol=1e-5, rtol=0)  # rounded to 6 decimals
        assert list(fig.data[0].x) == [f"{p}: {t!r}<br>→ 'w20'" for p, t in enumerate(own_tokens(model, PROMPTS[b]))]
        assert f"at {n} positions of prompt {b}" in fig.layout.title.text
        assert fig.layout.meta["dla_plot"] == "positions_heatmap"
    last = assemble(model, [0, -1], by="head")[0]
    view = plots.token_text(last, component="L1.attn", prompt=2)
    html = view._repr_html_()
    column = last.blocks().labels.index("L1.attn")
    assert all(f">{t}</span>" in html for t in own_tokens(model, PROMPTS[2]))
    assert view.values.shape == (4,) and bool(view.values[1:3].isnan().all())
    for k, p in enumerate((0, 3)):  # the attributed positions: the whole block at any granularity
        assert math.isclose(float(view.values[p]), float(last.blocks().values[2, k, column]), abs_tol=0)
    assert "not attributed" in html and "L1.attn = " in html and html.count("<span") == 4
    head = plots.token_text(last, component="L1.H0", prompt=0)
    assert float(head.values[5]) == float(last.values[0, 1, last.labels.index("L1.H0")])
    with pytest.raises(InputError, match=r"component='L9.attn' is not one of"):
        plots.token_text(last, component="L9.attn")
