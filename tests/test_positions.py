"""Every position and any linear target in one forward pass (issue 18), against the model's own logits.

``attribute(..., position=[...] | slice | "all")`` attributes every (prompt, position) site of a padded batch in one
forward pass, to any linear function of the logits (a token minus a contrast, ``contrast="mean"``, a weighted set,
``target="next"``, ``target=None``: the model's top token, a target per prompt and position). The reference is
always the model's own output: a plain transformers forward of each prompt alone (``model._module``, no nnsight),
its logits at every position, undone from the family's soft-cap where it has one (the parts sum to the pre-cap
logit); for ``intervene=`` the same forward with a torch hook making the same edit. Also: each position's parts are
a one-position call's, the self-check's bound is per site, every granularity, padding-unsafe families, ``batch_size``,
``reduce="sum"``, token-id prompts, ``attribute_direction`` per position, remote == local on the loopback server,
and bad input named.
"""

from __future__ import annotations

import warnings

import bounds
import pytest
import torch
from conftest import (
    CONTRAST,
    PROMPTS,
    TARGET,
    cover,
    eager_model,
    hooked_output,
    is_source_refusal,
    serve_tiny,
    single_threaded,
    source_marks,
    tiny_model,
)

import dla_recipes
from dla_recipes import InputError, PositionAttribution
from dla_recipes.plan import build_plan, module_at
from dla_recipes.testing import tiny

FAMILIES = tiny.FAMILIES
UNSAFE = [f for f in FAMILIES if not dla_recipes.families.family_of(tiny.config(f)).padding_safe]
GRANULARITIES = ("block", "head", "neuron", "expert", "source")
WEIGHTED = {TARGET: 1.0, CONTRAST: -0.5, "w22": 2.0}  # a weighted set: 1 * z[w20] - 0.5 * z[w21] + 2 * z[w22]

PROMISE = 1e-4  # the float32 promise: the parts sum to the model's own logit within 1e-4 * max(1, |logit|)


def ids_of(model, prompt) -> list[int]:
    """A prompt's own token ids, as ``attribute`` tokenizes it (ids given: as given)."""
    return list(prompt) if not isinstance(prompt, str) else list(model.tokenizer(prompt)["input_ids"])


def own_logits(model, prompt) -> torch.Tensor:
    """``[pos, vocab]`` float64: a plain transformers forward of one unpadded prompt (no nnsight), its logits at
    every position, the family's soft-cap ``c * tanh(z / c)`` undone (``z = c * atanh(y / c)``: the parts sum to
    the pre-cap logit; exact up to ``y``'s float32 rounding times ``1 / (1 - (y / c)^2)``, see
    ``conftest.plain_differences``)."""
    ids = torch.tensor([ids_of(model, prompt)])
    with torch.no_grad():
        y = model._module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()
    cap = build_plan(model).softcap
    if cap is not None:
        assert bool((y.abs() < cap).all()), f"a soft-capped logit at the cap {cap}"
        y = cap * torch.atanh(y / cap)
    return y


def token_id(model, token) -> int:
    return int(token) if isinstance(token, int) else model.tokenizer.convert_tokens_to_ids(token)


def linear_rounding(reference, b: int, p: int, z: torch.Tensor, rounding: torch.Tensor) -> float:
    """Model: ``reference(b, p, z)`` is linear in the logits ``z`` (``[pos, vocab]``; ``max`` picks one): it is
    rounded by ``sum_t |d reference / d z_t| * rounding_t``, ``rounding`` each logit's (``bounds.logit_rounding``)."""
    z = z.detach().clone().requires_grad_(True)
    (weights,) = torch.autograd.grad(reference(b, p, z), z)
    return float((weights.abs() * rounding).sum())


def site_bound(reference, b: int, p: int, z: torch.Tensor, rounding: torch.Tensor) -> float:
    """Model: the parts (the trace's forward of the padded batch, read along the logits' rows) and the plain
    forward of the prompt alone each round ``reference`` as a forward does (``linear_rounding``): twice that,
    capped by the float32 promise (above it on the real models: their logits are 576- to 640-term dots)."""
    want = float(reference(b, p, z))
    return min(2 * linear_rounding(reference, b, p, z, rounding), PROMISE * max(1.0, abs(want)))


def check_sites(model, attr, prompts, expected, reference, what: str) -> float:
    """Each site's parts (``values`` summed, plus ``constant``) against ``reference(b, p, z)``, the model's own value
    at prompt ``b``'s own position ``p`` (``z``: ``own_logits`` of prompt ``b``). ``expected``: each prompt's own
    positions in column order (the mask and ``positions`` must say exactly these). Masked entries are NaN.
    Returns the largest gap over its bound; asserts each site within ``site_bound`` and its own self-check bound."""
    assert isinstance(attr, PositionAttribution), (what, type(attr))
    assert len(attr) == len(prompts) and attr.prompts == tuple(attr.prompts)
    bound = attr.diagnostics["bound"]
    assert bound.shape == attr.mask.shape, (what, tuple(bound.shape))
    worst = 0.0
    for b, prompt in enumerate(prompts):
        own = [int(p) for p in attr.positions[b] if p >= 0]
        assert own == list(expected[b]), (what, b, own, expected[b])
        assert attr.mask[b].tolist() == [k < len(own) for k in range(attr.n_positions)], (what, b)
        masked = ~attr.mask[b]
        assert bool(attr.values[b][masked].isnan().all() and attr.logit[b][masked].isnan().all()), (what, b)
        assert bool(bound[b][masked].isnan().all() and bound[b][~masked].isfinite().all()), (what, b)
        z = own_logits(model, prompt)
        rounding = bounds.logit_rounding(model, ids_of(model, prompt))
        for k, p in enumerate(own):
            total = float(attr.values[b, k].double().sum() + attr.constant[b, k].double())
            want = float(reference(b, p, z))
            gap = abs(total - want)
            # the self-check's bound is this site's own (its logit's size), and the parts are within it of the model
            assert gap <= float(bound[b, k]), f"{what}: prompt {b} position {p}: gap {gap:.3g} > bound {bound[b, k]}"
            limit = site_bound(reference, b, p, z, rounding)  # both forwards' rounding of the logit (bounds.py)
            # a zero direction (the top token is the contrast) rounds to nothing: its parts must be exactly 0
            worst = max(worst, gap / limit if limit > 0 else (0.0 if gap == 0 else float("inf")))
            assert gap <= limit, f"{what}: prompt {b} position {p}: parts {total}, model {want}"
    return worst


def batch_bound(model, prompts, reference, positions) -> torch.Tensor:
    """``[len(prompts)]``: what a site's values, constant and logit may move by between two batchings of its prompt
    (prompt ``b`` at its own position ``positions[b]``). Model: each batching rounds the site's logit as a forward
    does (``linear_rounding``), and each part is one of the terms of the stream that logit reads: twice that."""
    limits, seen = [], {}
    for b, prompt in enumerate(prompts):
        key = tuple(ids_of(model, prompt))
        if key not in seen:
            seen[key] = (own_logits(model, prompt), bounds.logit_rounding(model, key))
        z, rounding = seen[key]
        limits.append(2 * linear_rounding(reference, b, positions[b], z, rounding))
    return torch.tensor(limits, dtype=torch.float64)


def attribution_bound(model, attr, reference) -> torch.Tensor:
    """``[rows]``: ``batch_bound`` at each row of ``attr`` (its prompt, at its own position)."""
    return batch_bound(model, list(attr.prompts), reference, [int(p) for p in attr.positions])


def batch_ratio(ours, theirs, limit: torch.Tensor) -> float:
    """The largest ``|ours - theirs|`` of a site's row (values, or the constant or logit) over its ``limit``."""
    gap = (ours.double() - theirs.double()).nan_to_num().abs()
    gap = gap.flatten(1).amax(-1) if gap.dim() > 1 else gap
    return float((gap / limit).max())


def assert_rows_within(model, ours, theirs, reference, what="") -> float:
    """``ours`` and ``theirs``: the same prompts' rows (one site a row) from two computations (another batching, a
    prompt alone, another process): each row's values and logit within both forwards' rounding of its logit
    (``attribution_bound``, with ``reference(b, p, z)`` the row's quantity). Returns the largest gap over its bound."""
    limit = attribution_bound(model, theirs, reference)
    ratio = max(batch_ratio(ours.values, theirs.values, limit), batch_ratio(ours.logit, theirs.logit, limit))
    assert ratio <= 1, (what, ratio)
    return ratio


def targets_of(model, attr):
    """``reference(b, p, z)``: row ``b``'s target logit minus its contrast's (``attr``'s tokens, one or one a row)."""
    def one(token):
        encoded = model.tokenizer(token, add_special_tokens=False).input_ids if isinstance(token, str) else [token]
        return int(encoded[0]) if len(encoded) == 1 else token_id(model, token)

    def ids(tokens):
        tokens = list(tokens) if tokens else []
        return [one(t) for t in (tokens * len(attr.prompts) if len(tokens) == 1 else tokens)]

    t, c = ids(attr.target_tokens), ids(attr.contrast_tokens)
    return lambda b, p, z: z[p, t[b]] - (z[p, c[b]] if c else 0.0)


def every_position(model, prompts=PROMPTS) -> list[list[int]]:
    return [list(range(len(ids_of(model, p)))) for p in prompts]


def difference(model, target=TARGET, contrast=CONTRAST):
    t, c = token_id(model, target), token_id(model, contrast)
    return lambda b, p, z: z[p, t] - z[p, c]


# -- every position: the model's own logits ------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_every_position_is_the_models_logit(family):
    """``position="all"`` over the padded batch (6, 2 and 4 tokens; a padding-unsafe family grouped by length): at
    every site the parts sum to the plain forward's logit(target) - logit(contrast) at that position, within that
    site's own self-check bound; masked entries are NaN. Each position is also the one-position call's (the same
    prompts, ``position=k``) to float rounding at a column of each padding pattern (three, two and one prompts
    have it): one pass over every site is no different from one pass a site."""
    model = tiny_model(family)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position="all")
    check_sites(model, attr, PROMPTS, every_position(model), difference(model), family)
    assert attr.target_tokens[0][0] == TARGET and attr.contrast_tokens[0][0] == CONTRAST
    # one column of each membership (6, 2 and 4 tokens: columns 0-1 hold three prompts, 2-3 two, 4-5 one)
    for k in sorted({1, 3, attr.n_positions - 1}):
        members = [b for b in range(len(PROMPTS)) if attr.mask[b, k]]
        alone = dla_recipes.attribute(model, [PROMPTS[b] for b in members], TARGET, contrast=CONTRAST, position=k)
        column = attr.at(k)
        assert column.labels == alone.labels and column.values.shape == alone.values.shape
        limit = batch_bound(model, [PROMPTS[b] for b in members], lambda b, p, z: difference(model)(b, p, z),
                            [k] * len(members))  # both batchings' rounding of the site's logit (batch_bound)
        for name in ("values", "constant", "logit"):
            ratio = batch_ratio(getattr(column, name), getattr(alone, name), limit)
            assert ratio <= 1, f"{family}: column {k}'s {name} differs from position={k} alone by {ratio:.3g} bounds"


TARGET_KINDS = ("mean", "weighted", "top", "next", "grid")


@pytest.mark.parametrize(("family", "kind"), cover(FAMILIES, TARGET_KINDS, per_family=1))
def test_linear_targets_are_the_models(family, kind):
    """Any linear function of the logits, at every position, against the plain forward: ``contrast="mean"``
    (logit - the mean logit over the vocabulary), a weighted set (sum of w * logit), ``target=None`` (the plain
    forward's own argmax at each position is the token attributed), ``target="next"`` (each position's next token;
    the last position left out) and a target per prompt and position (a ``[batch, n_positions]`` tensor). The
    target is resolved on the client into one direction on the logits; what a family changes about it (its final
    norm, soft-cap, padding) is met by each kind on a cover of the families (``conftest.cover``)."""
    model = tiny_model(family)
    t, c = token_id(model, TARGET), token_id(model, CONTRAST)
    everywhere = every_position(model)
    if kind == "mean":
        mean = dla_recipes.attribute(model, PROMPTS, TARGET, contrast="mean", position="all")
        check_sites(model, mean, PROMPTS, everywhere, lambda b, p, z: z[p, t] - z[p].mean(), f"{family} mean")
        assert mean.contrast_tokens[0][0] == "mean"
    elif kind == "weighted":
        ids = {token_id(model, k): w for k, w in WEIGHTED.items()}
        weighted = dla_recipes.attribute(model, PROMPTS, WEIGHTED, position="all")
        check_sites(model, weighted, PROMPTS, everywhere, lambda b, p, z: sum(w * z[p, i] for i, w in ids.items()),
                    f"{family} weighted")
    elif kind == "top":
        top = dla_recipes.attribute(model, PROMPTS, None, contrast=CONTRAST, position="all")
        check_sites(model, top, PROMPTS, everywhere, lambda b, p, z: z[p].max() - z[p, c], f"{family} top")
        for b, prompt in enumerate(PROMPTS):
            argmax = own_logits(model, prompt).argmax(-1).tolist()
            assert [model.tokenizer.decode([i]) for i in argmax] == list(top.target_tokens[b][:len(argmax)]), family
    elif kind == "next":
        following = [ids_of(model, p) for p in PROMPTS]
        nxt = dla_recipes.attribute(model, PROMPTS, "next", position="all")
        check_sites(model, nxt, PROMPTS, [own[:-1] for own in everywhere],
                    lambda b, p, z: z[p, following[b][p + 1]], f"{family} next")
    else:
        grid = torch.randint(0, 60, (len(PROMPTS), 6), generator=torch.Generator().manual_seed(0))
        per_site = dla_recipes.attribute(model, PROMPTS, grid, contrast=CONTRAST, position="all")
        check_sites(model, per_site, PROMPTS, everywhere, lambda b, p, z: z[p, grid[b, p]] - z[p, c],
                    f"{family} grid")


ID_FORMS = ("lists", "encoding", "tensor", "one")


@pytest.mark.parametrize(("family", "form"), cover(FAMILIES, ID_FORMS, per_family=1))
def test_token_id_prompts_are_the_models(family, form):
    """Prompts given as token ids (a list of id lists of different lengths, a tokenizer's padded ``BatchEncoding``,
    a ``[batch, pos]`` tensor of equal-length prompts, one list of ints) against the plain forward of those ids
    alone, at every position; the same as the text prompts. The ids are read on the client (one form a case, on a
    cover of the families: ``conftest.cover``)."""
    model = tiny_model(family)
    lists = [ids_of(model, p) for p in PROMPTS]
    if form == "lists":
        text = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position="all")
        as_lists = dla_recipes.attribute(model, lists, TARGET, contrast=CONTRAST, position="all")
        check_sites(model, as_lists, lists, every_position(model, lists), difference(model), f"{family} id lists")
        assert torch.equal(as_lists.values.nan_to_num(), text.values.nan_to_num()), family
    elif form == "encoding":
        encoding = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)
        as_encoding = dla_recipes.attribute(model, encoding, TARGET, contrast=CONTRAST, position="all")
        check_sites(model, as_encoding, lists, every_position(model, lists), difference(model), f"{family} encoding")
    elif form == "tensor":
        square = torch.tensor([lists[0], [t + 20 for t in lists[0]]])  # two prompts of 6 tokens: no padding
        as_tensor = dla_recipes.attribute(model, square, TARGET, contrast=CONTRAST, position=[0, 2, -1])
        check_sites(model, as_tensor, square.tolist(), [[0, 2, 5]] * 2, difference(model), f"{family} tensor")
    else:
        one = dla_recipes.attribute(model, lists[2], TARGET, contrast=CONTRAST, position=slice(1, None))
        check_sites(model, one, [lists[2]], [[1, 2, 3]], difference(model), f"{family} one id list")


def _granularity_cases():
    """A cover of families x granularities (``conftest.cover``, one granularity a family beyond each group's
    family, which meets them all: every granularity at one position is test_families.py's full product; here the
    new dimension is several positions)."""
    for family, by in cover(FAMILIES, GRANULARITIES, per_family=1):
        yield pytest.param(family, by, marks=source_marks(family) if by == "source" else ())


@pytest.mark.parametrize(("family", "by"), list(_granularity_cases()))
def test_every_granularity_at_several_positions(family, by):
    """At ``by`` (block, head, neuron, expert, source), two positions a prompt (its first and its last token, so
    the two columns sit at different padded positions in each row): every site's parts sum to the plain forward.
    A model whose experts are not split refuses ``by="expert"``, a model ``by="source"`` cannot split refuses
    clearly (``conftest.is_source_refusal``): both as at one position."""
    model = eager_model(family) if by == "source" else tiny_model(family)
    if by == "expert":
        try:
            build_plan(model).require("expert")
        except InputError:
            with pytest.raises(InputError, match="by='expert'"):
                dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position=[0, -1], by="expert")
            return
    try:
        attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position=[0, -1], by=by)
    except dla_recipes.DLAError as error:
        if by == "source" and is_source_refusal(error):
            return
        raise
    lengths = [len(ids_of(model, p)) for p in PROMPTS]
    check_sites(model, attr, PROMPTS, [[0, n - 1] for n in lengths], difference(model), f"{family} by={by}")
    assert len(set(attr.labels)) == len(attr.labels) == attr.values.shape[-1]
    if by == "source":  # a source is a token of the prompt's own: none after the site's own position
        assert any(".S" in label for label in attr.labels), f"{family}: by='source' split no head"
        for b, n in enumerate(lengths):
            first = attr.values[b, 0]
            later = [i for i, label in enumerate(attr.labels) if ".S" in label and int(label.rsplit(".S", 1)[1]) > 0]
            assert bool((first[later] == 0).all()), f"{family}: position 0 of prompt {b} read a later source"


# -- intervene=: an ablated head at every position -------------------------------------------------------------------

EDITED = ["llama", "gpt2", "gemma2", "gpt_neox", "mixtral", "deepseek_v3", "recurrent_gemma"]


def _ablate(hs):
    def ablate(m):
        hs.site(m).input[hs.index] = 0

    return ablate


@pytest.mark.parametrize("family", EDITED)
def test_ablated_head_is_zero_at_every_position(family):
    """``intervene=`` zeroing one head's slice of its output projection's input, ``position="all"``: the head's part
    is exactly 0 at every site (it is not in the clean run), and every site's parts sum to a plain forward of the
    prompt alone with the same edit made by a torch pre-hook."""
    model = tiny_model(family)
    plan = build_plan(model)
    layer = next(i for i, terms in enumerate(plan.layers) if any(t.term.splits_heads and t.parts for t in terms))
    hs = dla_recipes.head_slice(model, layer, 1)
    label = f"L{layer}.H1"
    clean = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position="all", by="head")
    edited = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position="all", by="head",
                                   intervene=_ablate(hs))
    column = edited.labels.index(label)
    assert bool((edited.values[..., column][edited.mask] == 0).all()), family
    assert bool((clean.values[..., column][clean.mask] != 0).all()), family

    def zero(_, args):
        x = args[0].clone()
        x[hs.index] = 0
        return (x,) + tuple(args[1:])

    handle = hs.site(model)._module.register_forward_pre_hook(zero)
    try:
        check_sites(model, edited, PROMPTS, every_position(model), difference(model), f"{family} ablated")
    finally:
        handle.remove()


# -- how prompts are batched -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", UNSAFE)
def test_padding_unsafe_family_gives_each_site_its_own_logit(family):
    """A family that must not be padded (its prompts grouped by token count), with ``batch_size=2`` and two prompts
    of one length: every site is the plain forward's of its prompt alone, in the user's order, with no warning."""
    model = tiny_model(family)
    prompts = PROMPTS + ["w17 w18"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attr = dla_recipes.attribute(model, prompts, TARGET, contrast=CONTRAST, position="all", batch_size=2)
        nxt = dla_recipes.attribute(model, prompts, "next", position=slice(None, -1), batch_size=2)
    assert attr.prompts == tuple(prompts)
    check_sites(model, attr, prompts, every_position(model, prompts), difference(model), family)
    following = [ids_of(model, p) for p in prompts]
    check_sites(model, nxt, prompts, [own[:-1] for own in every_position(model, prompts)],
                lambda b, p, z: z[p, following[b][p + 1]], f"{family} next")


@pytest.mark.parametrize("family", ["llama", "gpt2", "recurrent_gemma"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_batch_size_splits_the_sites(family, batch_size):
    """``batch_size`` runs the prompts in several forward passes: the table is the one pass's (same mask, positions
    and labels; values to float rounding) and every site is the plain forward's."""
    model = tiny_model(family)
    whole = dla_recipes.attribute(model, PROMPTS, "next", contrast="mean", position="all")
    split = dla_recipes.attribute(model, PROMPTS, "next", contrast="mean", position="all", batch_size=batch_size)
    assert torch.equal(split.mask, whole.mask) and torch.equal(split.positions, whole.positions)
    assert split.labels == whole.labels and split.target_tokens == whole.target_tokens
    following = [ids_of(model, p) for p in PROMPTS]
    for k in range(whole.n_positions):  # both batchings' rounding of each site's logit (batch_bound)
        members = [b for b in range(len(PROMPTS)) if whole.mask[b, k]]
        limit = batch_bound(model, [PROMPTS[b] for b in members],
                            lambda b, p, z, m=members: z[p, following[m[b]][p + 1]] - z[p].mean(), [k] * len(members))
        ratio = batch_ratio(split.values[members, k], whole.values[members, k], limit)
        assert ratio <= 1, (family, batch_size, k, ratio)
    check_sites(model, split, PROMPTS, [own[:-1] for own in every_position(model)],
                lambda b, p, z: z[p, following[b][p + 1]] - z[p].mean(), f"{family} batch_size={batch_size}")
    # a target per prompt and position: each batch reads its own prompts' rows and columns of the grid
    grid = torch.randint(0, 60, (len(PROMPTS), 6), generator=torch.Generator().manual_seed(1))
    per_site = dla_recipes.attribute(model, PROMPTS, grid, contrast=CONTRAST, position="all", batch_size=batch_size)
    c = token_id(model, CONTRAST)
    check_sites(model, per_site, PROMPTS, every_position(model), lambda b, p, z: z[p, grid[b, p]] - z[p, c],
                f"{family} grid batch_size={batch_size}")


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "mixtral", "recurrent_gemma"])
def test_reduce_sum_is_the_sum_over_the_span(family):
    """``reduce="sum"``: one row a prompt whose parts sum to the sum of the plain forward's logits over the span
    (the log-likelihood-style sum of each next token's logit; a token over a slice, minus the mean)."""
    model = tiny_model(family)
    following = [ids_of(model, p) for p in PROMPTS]
    summed = dla_recipes.attribute(model, PROMPTS, "next", position="all", reduce="sum", by="head")
    assert isinstance(summed, dla_recipes.Attribution) and summed.values.shape[0] == len(PROMPTS)
    t = token_id(model, TARGET)
    span = dla_recipes.attribute(model, PROMPTS, TARGET, contrast="mean", position=slice(1, 3), reduce="sum")
    sites = {id(summed): dla_recipes.attribute(model, PROMPTS, "next", position="all", by="head"),  # the summed rows
             id(span): dla_recipes.attribute(model, PROMPTS, TARGET, contrast="mean", position=slice(1, 3))}
    for b, prompt in enumerate(PROMPTS):
        z = own_logits(model, prompt)
        rounding = bounds.logit_rounding(model, ids_of(model, prompt))
        n = len(following[b])
        cases = [(summed, lambda b, _, z, n=n: sum(z[p, following[b][p + 1]] for p in range(n - 1))),
                 (span, lambda b, _, z, n=n: sum(z[p, t] - z[p].mean() for p in range(1, min(3, n))))]
        for attr, reference in cases:
            total = float(attr.values[b].double().sum() + attr.constant[b].double())
            want = float(reference(b, None, z))
            # both forwards' rounding of each site's logit, and each column's float32 sum over the span's sites
            spans = bounds.sum_bound(sites[id(attr)].values[b].nan_to_num(), dim=0).sum()
            limit = min(2 * linear_rounding(reference, b, None, z, rounding) + float(spans),
                        PROMISE * max(1.0, abs(want)))
            assert abs(total - want) <= limit, (family, b, total, want)


# -- attribute_direction per position --------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "norm"), [("gpt2", "ln_2"), ("llama", "post_attention_layernorm")])
def test_direction_per_position(family, norm):
    """``attribute_direction`` with one direction a prompt and position (``[batch, n_positions, d]``) and one for
    all (``[d]``), ``position="all"``: every site's parts sum to the norm's own output (a forward hook on a plain
    forward of the prompt alone) at that position, along that site's direction."""
    model = tiny_model(family)
    d = int(model.lm_head.weight.shape[-1])
    directions = torch.randn(len(PROMPTS), 6, d, generator=torch.Generator().manual_seed(0))
    module = module_at(model.layers[1], norm)._module
    plan = build_plan(model)
    rounding = bounds.read_rounding(d, len(plan.components("block", stop=plan.stop_before(1, "mlp"))))
    for given, batch_size in ((directions, None), (directions, 1), (directions[0, 0], None)):
        attr = dla_recipes.attribute_direction(model, PROMPTS, given, layer=1, sublayer="mlp", position="all",
                                               batch_size=batch_size)
        assert attr.read_by.startswith("L1.")
        for b, prompt in enumerate(PROMPTS):
            normed = hooked_output(model, module, prompt).double()  # [pos, d]
            for k in range(len(ids_of(model, prompt))):
                v = (given[b, k] if given.dim() == 3 else given).double()
                want = float(normed[k] @ v)
                total = float(attr.values[b, k].double().sum() + attr.constant[b, k].double())
                # each side (the recipe, the plain forward) rounds the stream, norm and read as bounds.read_rounding
                limit = min(2 * rounding * float((normed[k] * v).abs().sum()), PROMISE * max(1.0, abs(want)))
                assert abs(total - want) <= limit, (family, b, k, total, want)
    with pytest.raises(InputError, match="direction"):
        dla_recipes.attribute_direction(model, PROMPTS, directions[:, :3], layer=1, position="all")


# -- bad input -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"position": []}, r"position"),
    ({"position": [0, 7]}, r"position.* 7 .*outside"),
    ({"position": [0, -3]}, r"position -3 is outside prompt 1 \('w11 w12'\), which has 2 tokens: use -2\.\.1"),
    ({"position": -5}, r"2 prompts are too short for position=-5"),
    ({"position": slice(9, None)}, r"position"),
    ({"position": "every"}, r"position"),
    ({"prompts": ["w5 w6", "w7"], "target": "next", "position": "all"}, r"target='next'.*prompt 1"),
    ({"target": {TARGET: "1"}}, r"target.*weight"),
    ({"target": {TARGET: float("nan")}}, r"target.*weight"),
    ({"target": {}}, r"target"),
    ({"contrast": {CONTRAST: None}}, r"contrast.*weight"),
    ({"target": [[TARGET] * 2] * 3, "position": "all"}, r"target.*\[batch, n_positions\]"),
    ({"contrast": torch.zeros(3, 7, dtype=torch.long), "position": "all"}, r"contrast.*\[batch, n_positions\] = \[3, 6\]"),
    ({"reduce": "mean", "position": "all"}, r"reduce"),
    ({"prompts": [[5, 6], [7, 10_000]]}, r"prompt 1.*token ids outside"),
])
def test_bad_input_names_the_argument(kwargs, match):
    """Each bad argument is an ``InputError`` naming it (and the prompt or position at fault), before any forward."""
    model = tiny_model("llama")
    call = {"prompts": PROMPTS, "target": TARGET, "position": [0, -1]} | kwargs
    with pytest.raises(InputError, match=match):
        dla_recipes.attribute(model, call.pop("prompts"), call.pop("target"), **call)


# -- remote == local on the loopback NDIF server ---------------------------------------------------------------------

SERVED = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_positions")
    with serve_tiny(root, SERVED) as running:
        yield running


@pytest.mark.server
@pytest.mark.parametrize("family", SERVED)
@pytest.mark.parametrize(("target", "contrast", "by"), [(TARGET, CONTRAST, "head"), ("next", "mean", "neuron"),
                                                        (None, None, "block")])
def test_remote_equals_local(server, family, target, contrast, by):
    """Every position on the loopback server (the recipe travels by value; ``target=None`` runs its extra forward
    pass there too) equals the local run bit for bit, both single-threaded; and the local run is the plain
    forward's."""
    remote_model, local_model = server.remote_model(family), server.local_model(family)
    with server.client():
        remote = dla_recipes.attribute(remote_model, PROMPTS, target, contrast=contrast, position="all", by=by,
                                       remote=True)
    with single_threaded():
        local = dla_recipes.attribute(local_model, PROMPTS, target, contrast=contrast, position="all", by=by)
    assert remote.labels == local.labels and torch.equal(remote.mask, local.mask)
    assert remote.target_tokens == local.target_tokens
    assert torch.equal(remote.values.nan_to_num(), local.values.nan_to_num())
    assert torch.equal(remote.constant.nan_to_num(), local.constant.nan_to_num())
    # the model's own logit: lm_head on a strided input, its last bits may differ between two processes (test_remote):
    # within both computations' rounding of each site's (batch_bound)
    following = [ids_of(local_model, p) for p in PROMPTS]
    reference = {TARGET: difference(local_model), "next": lambda b, p, z: z[p, following[b][p + 1]] - z[p].mean(),
                 None: lambda b, p, z: z[p].max()}[target]
    for k in range(local.n_positions):
        members = [b for b in range(len(PROMPTS)) if local.mask[b, k]]
        limit = batch_bound(tiny_model(family), [PROMPTS[b] for b in members],
                            lambda b, p, z, m=members: reference(m[b], p, z), [k] * len(members))
        assert batch_ratio(remote.logit[members, k], local.logit[members, k], limit) <= 1
    assert all(p.device.type == "meta" for p in remote_model._module.parameters())
    if target == TARGET:
        check_sites(local_model, local, PROMPTS, every_position(local_model), difference(local_model), family)
