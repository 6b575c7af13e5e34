"""Every position on the real models (SmolLM2-135M-Instruct, Gemma-3-270M), against a plain transformers forward.

The padded batch of three prompts of different lengths, ``position="all"``: every site's parts sum to the model's own
logits at that position (a plain forward of each prompt alone, no nnsight) for a token minus a contrast,
``contrast="mean"``, a weighted set, ``target=None`` (the plain forward's argmax is the token attributed),
``target="next"`` and token-id prompts; each position is the one-position call's; ``reduce="sum"`` is the sum over
the span. SmolLM2 shares one load and runs in ``make test-fast``; Gemma-3-270M's load is the slow one.
"""

import bounds
import pytest
import torch
from test_positions import PROMISE, batch_bound, batch_ratio, check_sites, ids_of, linear_rounding, own_logits

import dla_recipes
from dla_recipes import models

PROMPTS = ["The Eiffel Tower is in the city of", "The capital of Italy is", "Paris is the capital of France"]
PARIS, ROME = " Paris", " Rome"

pytestmark = pytest.mark.real
MODELS = ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)]

# Every tolerance below is bounds.py's model of the two forwards' rounding (test_positions.site_bound and batch_bound):
# on these models a logit is a 576- or 640-term float32 dot, whose worst case (gamma_d * sum |W_U y|, ~5e-3 for
# SmolLM2's " Paris") is above the float32 promise 1e-4 * max(1, |logit|), so the promise bounds the sums.


@pytest.fixture(scope="module", params=MODELS)
def real_model(request):
    path = models.REGISTRY[request.param]()
    return dla_recipes.load(path, dtype=torch.float32, device_map="cpu")


def token(model, text: str) -> int:
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def everywhere(model, prompts=PROMPTS):
    return [list(range(len(ids_of(model, p)))) for p in prompts]


def test_every_position_is_the_models_logit(real_model):
    """``" Paris" - " Rome"`` at every position of the padded batch, per head: the plain forward's, within each
    site's own bound; each column is that position attributed alone (the prompts that have it)."""
    model = real_model
    paris, rome = token(model, PARIS), token(model, ROME)
    attr = dla_recipes.attribute(model, PROMPTS, PARIS, contrast=ROME, position="all", by="head")
    difference = lambda b, p, z: z[p, paris] - z[p, rome]
    check_sites(model, attr, PROMPTS, everywhere(model), difference, "paris - rome")
    for k in (0, 3, attr.n_positions - 1):
        members = [b for b in range(len(PROMPTS)) if attr.mask[b, k]]
        alone = dla_recipes.attribute(model, [PROMPTS[b] for b in members], PARIS, contrast=ROME, position=k,
                                      by="head")
        column = attr.at(k)
        # both batchings' rounding of the site's logit (test_positions.batch_bound)
        limit = batch_bound(model, [PROMPTS[b] for b in members], difference, [k] * len(members))
        for name in ("values", "constant", "logit"):
            ratio = batch_ratio(getattr(column, name), getattr(alone, name), limit)
            assert ratio <= 1, f"column {k}'s {name} differs from position={k} alone by {ratio:.3g} bounds"


def test_linear_targets_are_the_models(real_model):
    """``contrast="mean"``, a weighted set, ``target=None`` and ``target="next"`` at every position."""
    model = real_model
    paris = token(model, PARIS)
    mean = dla_recipes.attribute(model, PROMPTS, PARIS, contrast="mean", position="all")
    check_sites(model, mean, PROMPTS, everywhere(model), lambda b, p, z: z[p, paris] - z[p].mean(), "mean")

    weights = {PARIS: 1.0, ROME: -2.0, " London": 0.5}
    ids = {token(model, t): w for t, w in weights.items()}
    weighted = dla_recipes.attribute(model, PROMPTS, weights, position="all")
    check_sites(model, weighted, PROMPTS, everywhere(model), lambda b, p, z: sum(w * z[p, i] for i, w in ids.items()),
                "weighted")

    top = dla_recipes.attribute(model, PROMPTS, None, position="all")
    check_sites(model, top, PROMPTS, everywhere(model), lambda b, p, z: z[p].max(), "top")
    for b, prompt in enumerate(PROMPTS):
        argmax = own_logits(model, prompt).argmax(-1).tolist()
        assert [model.tokenizer.decode([i]) for i in argmax] == list(top.target_tokens[b][:len(argmax)]), b

    following = [ids_of(model, p) for p in PROMPTS]
    nxt = dla_recipes.attribute(model, PROMPTS, "next", position="all")
    check_sites(model, nxt, PROMPTS, [own[:-1] for own in everywhere(model)],
                lambda b, p, z: z[p, following[b][p + 1]], "next")


def test_token_ids_and_the_span_sum(real_model):
    """Token-id prompts (the tokenizer's own ids, lists of different lengths) at every position, and
    ``reduce="sum"`` of each next token's logit over the prompt: the plain forward's sum."""
    model = real_model
    paris, rome = token(model, PARIS), token(model, ROME)
    lists = [ids_of(model, p) for p in PROMPTS]
    as_ids = dla_recipes.attribute(model, lists, PARIS, contrast=ROME, position="all")
    check_sites(model, as_ids, lists, everywhere(model, lists), lambda b, p, z: z[p, paris] - z[p, rome], "ids")
    summed = dla_recipes.attribute(model, PROMPTS, "next", position="all", reduce="sum")
    for b, prompt in enumerate(PROMPTS):
        z = own_logits(model, prompt)
        reference = lambda b, _, z: sum(z[p, lists[b][p + 1]] for p in range(len(lists[b]) - 1))
        want = float(reference(b, None, z))
        total = float(summed.values[b].double().sum() + summed.constant[b].double())
        # both forwards' rounding of each next-token logit (test_positions.linear_rounding), capped by the promise
        rounding = bounds.logit_rounding(model, lists[b])
        limit = min(2 * linear_rounding(reference, b, None, z, rounding), PROMISE * max(1.0, abs(want)))
        assert abs(total - want) <= limit, (b, total, want)
