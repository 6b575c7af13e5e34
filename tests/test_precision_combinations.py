"""Half precision meets the other axes: ``attribute_direction`` in bfloat16 / float16 and remotely, remote bfloat16 /
float16 attribution, and NDIF's autocast bracket.

Every sum is checked against the model's own output, each prompt alone in a plain transformers forward: for a
direction, the output of the norm in front of the sublayer (a torch forward hook) along the direction; for a logit,
target minus contrast at the last token. In half precision the sum is held to two forwards' rounding (twice the
self-check's bound: the batch's and the prompt alone's). The loopback NDIF server serves a folder in the dtype it was saved in (``TransformersModel``
loads with the folder's ``dtype``), so a bfloat16 folder is a bfloat16 deployment; the server computes
single-threaded, and remote equals local bit for bit.

NDIF runs every request inside ``torch.autocast("cuda", dtype=<model dtype>)``; on the CPU
``torch.autocast("cpu", dtype=torch.bfloat16)`` reproduces it, locally and on the loopback server
(``LoopbackServer(..., autocast=True)``). The model's own forward does not move under it (its weights are already
bfloat16), but the recipe's float32 arithmetic would (issue 19): the recipe switches it off around its own products
(``math.linalg.exact``), and the parts under the bracket equal the parts without it.
"""

from __future__ import annotations

import contextlib
import secrets

import bounds
import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, hooked_output, single_threaded, tolerance
from test_positions import attribution_bound, batch_ratio, difference

import dla_recipes
from dla_recipes.plan import module_at
from dla_recipes.testing import tiny
from dla_recipes.testing.loopback import LoopbackServer

LAYER = 1
BY = ["block", "head", "neuron"]
# |parts sum - the model's own value| (the norm's output @ v, or the logit difference), each prompt alone, in half
# precision: two forwards (the padded batch, the prompt alone), each within the self-check's bound of its own
# rounding (selfcheck.py's model: the stream's adds, the norm's output and the logits as independent roundings, read
# from the call's diagnostics["bound"]): twice that. In float32, the promise. Measured before: 0.076 (bfloat16) and
# 0.011 (float16) for a direction, 2.2e-3 and 1.7e-4 of max(1, |logit|) for a logit, 0.12 of that bound at most.
HALF = (torch.bfloat16, torch.float16)
# family, sublayer -> the norm that reads the stream in front of that sublayer (native names)
NORMS = {("llama", "attn"): "input_layernorm", ("llama", "mlp"): "post_attention_layernorm",
         ("gpt2", "attn"): "ln_1", ("gpt2", "mlp"): "ln_2", ("gemma2", "mlp"): "pre_feedforward_layernorm"}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "f32"}
SERVED = [("llama", torch.bfloat16), ("gpt2", torch.bfloat16), ("mixtral", torch.bfloat16), ("llama", torch.float16),
          ("llama", torch.float32)]
HALF_SERVED = [f"{family}-{NAMES[dtype]}" for family, dtype in SERVED if dtype != torch.float32]
AUTOCAST_SERVED = ["llama-bf16", "gpt2-bf16"]


def each_once(names: list[str], options: list[str]) -> list[tuple[str, str]]:
    """A cover of ``names x options`` for the remote cases: every served model and every granularity at least once
    (name ``i`` with option ``i``, both taken in turn). The remote path ships the same trace for every granularity
    (remote equals local bit for bit is a property of the transport, not of the split), and each granularity's
    local sums are checked on every model and dtype by the local tests above."""
    return [(names[i % len(names)], options[i % len(options)]) for i in range(max(len(names), len(options)))]

_MODELS: dict = {}


def half_model(family: str, dtype: torch.dtype, eager: bool = False):
    """A tiny perturbed ``family`` model in ``dtype`` (cached); ``eager``: with eager attention (``by="source"``)."""
    if (family, dtype, eager) not in _MODELS:
        extra = {"attn_implementation": "eager"} if eager else {}
        _MODELS[family, dtype, eager] = dla_recipes.load(tiny.build(family).to(dtype), tokenizer=tiny.tokenizer(),
                                                         device_map="cpu", dispatch=True, **extra)
    return _MODELS[family, dtype, eager]


def dtype_of(model) -> torch.dtype:
    return next(model._module.parameters()).dtype


def direction(family: str, seed: int = 0) -> torch.Tensor:
    """A random ``[d_model]`` direction on the norm's output (a probe)."""
    torch.manual_seed(seed)
    return torch.randn(tiny.config(family).hidden_size)


def normed_along(model, norm: str, prompt: str, v: torch.Tensor) -> float:
    """The output of block ``LAYER``'s norm ``norm`` at the last token of ``prompt`` alone, along ``v``: a plain
    transformers forward (no nnsight) with a torch forward hook on that norm."""
    return float(hooked_output(model, module_at(model.layers[LAYER], norm)._module, prompt)[-1].double() @ v.double())


def logit_difference(model, prompt: str) -> float:
    """Target minus contrast at the last token of ``prompt`` alone, in a plain transformers forward."""
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        logits = model._module(**ids).logits[0, -1].double()
    target, contrast = (model.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (TARGET, CONTRAST))
    return float(logits[target] - logits[contrast])


def assert_direction_sums(attr, model, norm: str, v: torch.Tensor):
    """The parts sum to the norm's own output along ``v``, each prompt alone, within both forwards' rounding."""
    reference = torch.tensor([normed_along(model, norm, p, v) for p in PROMPTS])
    bound = 2 * attr.diagnostics["bound"] if dtype_of(model) in HALF else tolerance(reference)  # (above)
    gap = (attr.total - reference).abs()
    assert float((gap / bound).max()) <= 1, (gap, bound)
    # the logit is read from that norm's output in the trace: the plain forward's, to float32 rounding of the dot
    assert bool(((attr.logit - reference).abs() <= tolerance(reference)).all()), (attr.logit, reference)


def assert_logit_sums(attr, model):
    """The parts sum to the model's own logit difference, each prompt alone, within both forwards' rounding."""
    reference = torch.tensor([logit_difference(model, p) for p in PROMPTS])
    bound = 2 * attr.diagnostics["bound"] if dtype_of(model) in HALF else tolerance(reference)  # (above)
    gap = (attr.total - reference).abs()
    assert float((gap / bound).max()) <= 1, (gap, reference)


# -- attribute_direction in bfloat16 / float16, locally --------------------------------------------------------------


@pytest.mark.parametrize("by", BY)
@pytest.mark.parametrize("family,sublayer", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_direction_in_half_precision(dtype, family, sublayer, by):
    model = half_model(family, dtype)
    v = direction(family)
    attr = dla_recipes.attribute_direction(model, PROMPTS, v, layer=LAYER, sublayer=sublayer, by=by, progress=False)
    assert attr.values.dtype == torch.float32
    assert_direction_sums(attr, model, NORMS[family, sublayer], v)


# -- remote: a loopback NDIF server serving float32, bfloat16 and float16 folders -----------------------------------


def serve(tmp_path_factory, names, **options):
    root = tmp_path_factory.mktemp("served")
    folders = {}
    for family, dtype in SERVED:
        name = f"{family}-{NAMES[dtype]}"
        if name in names:
            folders[name] = str(root / name)
            tiny.build(family).to(dtype).save_pretrained(folders[name])
            tiny.tokenizer().save_pretrained(folders[name])
    return LoopbackServer(folders, api_key=secrets.token_hex(16), forked=True, **options)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory, [f"{f}-{NAMES[d]}" for f, d in SERVED]) as running:
        yield running


@pytest.fixture(scope="module")
def autocast_server(tmp_path_factory):
    """The same deployment behind NDIF's bracket: every request inside ``torch.autocast("cpu", <model dtype>)``."""
    with serve(tmp_path_factory, AUTOCAST_SERVED, autocast=True) as running:
        yield running


def remote_and_local(server, name: str, call, bracket=contextlib.nullcontext):
    """``call(model, remote)`` on the served model and on the same folder loaded locally (single-threaded, as the
    server computes, inside ``bracket()``); returns ``(remote, local, the local model)``."""
    if (server.url, name) not in _MODELS:  # built once per server
        _MODELS[server.url, name] = server.remote_model(name), server.local_model(name, dispatch=True)
    remote_model, local_model = _MODELS[server.url, name]
    with server.client():
        remote = call(remote_model, True)
    with single_threaded(), bracket():
        local = call(local_model, False)
    assert all(p.device.type == "meta" for p in remote_model._module.parameters())  # it all ran server side
    assert dtype_of(local_model) == {"bf16": torch.bfloat16, "fp16": torch.float16, "f32": torch.float32}[
        name.rsplit("-", 1)[1]]
    return remote, local, local_model


def assert_identical(remote, local, limit: torch.Tensor):
    """Remote equals local bit for bit: the same code on the same CPU, single-threaded, in the same dtype (measured:
    0.0 on every case here, bfloat16 and float16 included); the float32 logit of a batch can differ in its last bits
    (test_remote.py): within ``limit`` ``[prompts]``, both computations' rounding of it."""
    assert remote.labels == local.labels
    assert torch.equal(remote.values, local.values), float((remote.values - local.values).abs().max())
    assert torch.equal(remote.constant, local.constant)
    assert batch_ratio(remote.logit, local.logit, limit) <= 1


def direction_rounding(model, norm: str, v: torch.Tensor) -> torch.Tensor:
    """``[prompts]``: both computations' rounding of the norm's output read along ``v`` (a ``d``-term float32 dot,
    ``bounds.dot_bound``, and its half ulp), each prompt's last token."""
    outputs = [hooked_output(model, module_at(model.layers[LAYER], norm)._module, p)[-1] for p in PROMPTS]
    return torch.tensor([2 * (float(bounds.dot_bound(y, v)) + bounds.half_ulp(float(y.double() @ v.double())))
                         for y in outputs], dtype=torch.float64)


@pytest.mark.parametrize(("name", "by"), each_once(["llama-f32", "llama-bf16", "llama-fp16", "gpt2-bf16"], BY))
@pytest.mark.server
def test_remote_direction(server, name, by):
    v = direction(name.split("-")[0], 1)

    def call(model, remote):
        return dla_recipes.attribute_direction(model, PROMPTS, v, layer=LAYER, sublayer="mlp", by=by, remote=remote,
                                               progress=False)

    remote, local, model = remote_and_local(server, name, call)
    norm = NORMS[name.split("-")[0], "mlp"]
    assert_identical(remote, local, direction_rounding(model, norm, v))
    assert_direction_sums(remote, model, norm, v)


@pytest.mark.parametrize(("name", "by"), each_once(HALF_SERVED, BY))
@pytest.mark.server
def test_remote_half_precision(server, name, by):
    def call(model, remote):
        return dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, remote=remote, progress=False)

    remote, local, model = remote_and_local(server, name, call)
    assert_identical(remote, local, attribution_bound(model, local, difference(model)))
    assert_logit_sums(remote, model)


# -- NDIF's autocast bracket --------------------------------------------------------------------------------------


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("by", BY)
@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_autocast_sums_match_the_plain_forward(family, by):
    """Inside the bracket NDIF puts around a request: the parts sum to the model's own logit under the same bracket."""
    model = half_model(family, torch.bfloat16)
    with autocast():
        attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, progress=False)
        assert_logit_sums(attr, model)


@pytest.mark.parametrize("by", ["block", "head", "neuron", "source"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_autocast_leaves_the_parts_alone(family, by):
    """The bracket does not move a bfloat16 model's own forward (its weights are bfloat16 already), so it must not
    move the parts: they are the recipe's float32 arithmetic. Measured before the recipe switched autocast off
    around its own products (``math.linalg.exact``): the parts moved by up to 1.6e-3 of the largest part at
    by="head" (llama; gpt2 2.3e-4) and 1.6e-4 at by="neuron" (llama; gpt2 6.3e-5), not at by="block"; after: 0."""
    model = half_model(family, torch.bfloat16, eager=by == "source")
    plain = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, progress=False)
    with autocast():
        bracketed = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, progress=False)
    assert torch.equal(bracketed.logit, plain.logit)  # the model's own forward: unmoved
    moved = float((bracketed.values - plain.values).abs().max())
    assert moved <= 1e-5 * float(plain.values.abs().max()), moved


@pytest.mark.parametrize(("name", "by"), each_once(AUTOCAST_SERVED, BY))
@pytest.mark.server
def test_remote_under_autocast(autocast_server, name, by):
    """The loopback server with NDIF's bracket: a request runs under it (a tensor made in the trace is bfloat16),
    remote equals local under the same bracket bit for bit, and the parts sum to the plain forward under it."""
    probe = autocast_server.remote_model(name)
    with autocast_server.client(), torch.no_grad(), probe.trace(PROMPTS[0], remote=True):
        made = (torch.ones(2, 2) @ torch.ones(2, 2)).save()
    assert made.dtype == torch.bfloat16  # the bracket is on

    def call(model, remote):
        return dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, remote=remote, progress=False)

    remote, local, model = remote_and_local(autocast_server, name, call, autocast)
    with autocast():
        assert_identical(remote, local, attribution_bound(model, local, difference(model)))
    with autocast():
        assert_logit_sums(remote, model)
