"""Every position on the real models (SmolLM2-135M-Instruct, Gemma-3-270M), against a plain transformers forward.

The padded batch of three prompts of different lengths, ``position="all"``: every site's parts sum to the model's own
logits at that position (a plain forward of each prompt alone, no nnsight) for a token minus a contrast,
``contrast="mean"``, a weighted set, ``target=None`` (the plain forward's argmax is the token attributed),
``target="next"`` and token-id prompts; each position is the one-position call's; ``reduce="sum"`` is the sum over
the span. SmolLM2 shares one load and runs in ``make test-fast``; Gemma-3-270M's load is the slow one.
"""

import pytest
import torch
from test_positions import check_sites, ids_of, own_logits

import dla_recipes
from dla_recipes import models

PROMPTS = ["The Eiffel Tower is in the city of", "The capital of Italy is", "Paris is the capital of France"]
PARIS, ROME = " Paris", " Rome"

pytestmark = pytest.mark.real
MODELS = ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)]

# The largest |parts - the model's own| / max(1, |own|) over every site of the tests below, measured in float32 on
# one thread: SmolLM2 8.9e-6 (the weighted set; " Paris" - " Rome" 5.8e-6, token ids 6.1e-6, "mean" 4.6e-6),
# Gemma-3-270M 6.1e-6 (the weighted set). ~2x.
TOL = 2e-5
# |a column - the same position attributed alone, in a batch padded differently|: measured values 6.0e-7, constant
# 0.0, logit 3.8e-6 (absolute; logits of ~10-20) over both models on an AVX2 machine, the logit 9.5e-6 for
# Gemma-3-270M on an AVX-512 / AMX Xeon (five float32 ulps of a logit near 20: the model's own rounding in another
# padded batch). ~2x.
SAME = 8e-6
SAME_LOGIT = 2e-5


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
    check_sites(model, attr, PROMPTS, everywhere(model), lambda b, p, z: z[p, paris] - z[p, rome],
                "paris - rome", TOL)
    for k in (0, 3, attr.n_positions - 1):
        members = [b for b in range(len(PROMPTS)) if attr.mask[b, k]]
        alone = dla_recipes.attribute(model, [PROMPTS[b] for b in members], PARIS, contrast=ROME, position=k,
                                      by="head")
        column = attr.at(k)
        for name in ("values", "constant", "logit"):
            gap = float((getattr(column, name) - getattr(alone, name)).abs().max())
            bound = SAME_LOGIT if name == "logit" else SAME
            assert gap <= bound, f"column {k}'s {name} differs from position={k} alone by {gap:.3g}"


def test_linear_targets_are_the_models(real_model):
    """``contrast="mean"``, a weighted set, ``target=None`` and ``target="next"`` at every position."""
    model = real_model
    paris = token(model, PARIS)
    mean = dla_recipes.attribute(model, PROMPTS, PARIS, contrast="mean", position="all")
    check_sites(model, mean, PROMPTS, everywhere(model), lambda b, p, z: z[p, paris] - z[p].mean(), "mean", TOL)

    weights = {PARIS: 1.0, ROME: -2.0, " London": 0.5}
    ids = {token(model, t): w for t, w in weights.items()}
    weighted = dla_recipes.attribute(model, PROMPTS, weights, position="all")
    check_sites(model, weighted, PROMPTS, everywhere(model), lambda b, p, z: sum(w * z[p, i] for i, w in ids.items()),
                "weighted", TOL)

    top = dla_recipes.attribute(model, PROMPTS, None, position="all")
    check_sites(model, top, PROMPTS, everywhere(model), lambda b, p, z: z[p].max(), "top", TOL)
    for b, prompt in enumerate(PROMPTS):
        argmax = own_logits(model, prompt).argmax(-1).tolist()
        assert [model.tokenizer.decode([i]) for i in argmax] == list(top.target_tokens[b][:len(argmax)]), b

    following = [ids_of(model, p) for p in PROMPTS]
    nxt = dla_recipes.attribute(model, PROMPTS, "next", position="all")
    check_sites(model, nxt, PROMPTS, [own[:-1] for own in everywhere(model)],
                lambda b, p, z: z[p, following[b][p + 1]], "next", TOL)


def test_token_ids_and_the_span_sum(real_model):
    """Token-id prompts (the tokenizer's own ids, lists of different lengths) at every position, and
    ``reduce="sum"`` of each next token's logit over the prompt: the plain forward's sum."""
    model = real_model
    paris, rome = token(model, PARIS), token(model, ROME)
    lists = [ids_of(model, p) for p in PROMPTS]
    as_ids = dla_recipes.attribute(model, lists, PARIS, contrast=ROME, position="all")
    check_sites(model, as_ids, lists, everywhere(model, lists), lambda b, p, z: z[p, paris] - z[p, rome], "ids", TOL)
    summed = dla_recipes.attribute(model, PROMPTS, "next", position="all", reduce="sum")
    for b, prompt in enumerate(PROMPTS):
        z = own_logits(model, prompt)
        want = float(sum(z[p, lists[b][p + 1]] for p in range(len(lists[b]) - 1)))
        total = float(summed.values[b].double().sum() + summed.constant[b].double())
        assert abs(total - want) <= TOL * max(1.0, abs(want)), (b, total, want)
