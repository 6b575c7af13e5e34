"""Recipes that compose with the user's own edits: ablate or patch, then attribute, in one forward pass.

Every edit is checked against the model's own output under the same edit made without nnsight: a plain
transformers forward of each prompt alone, with a torch forward pre-hook on the underlying output projection. The
attribution's parts must sum to that logit (difference), on SmolLM2 and on tiny models of seven families (a
post-norm, a parallel and two mixture-of-experts families among them), on padded batches; the ablated head's
direct part must be exactly 0; ``trace_attribution`` inside the user's own trace must equal
``attribute(..., intervene=...)``; a misplaced call must raise ``TraceUsageError``; remote must equal local.
"""

from __future__ import annotations

import contextlib
import secrets

import nnsight
import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, single_threaded, tiny_model, tolerance
from test_positions import assert_rows_within, attribution_bound, batch_ratio, targets_of

import dla_recipes
from dla_recipes import TraceUsageError, models
from dla_recipes.plan import module_at

# llama-like, Conv1D, post-norm (sandwich), post-norm only, parallel, two mixtures of experts
FAMILIES = ["llama", "gpt2", "gemma2", "olmo2", "gptj", "mixtral", "qwen2_moe"]
CORRUPT = ["w30 w31 w32 w33 w34 w35", "w36 w37", "w38 w39 w40 w41"]  # one corrupted prompt per clean prompt
LAYER, HEAD = 1, 1


def head_slice(model, layer: int, head: int) -> tuple[str, slice]:
    """The path of block ``layer``'s attention output projection and head ``head``'s slice of its input."""
    hs = dla_recipes.head_slice(model, layer, head)  # none of these families has a grouped projection
    return hs.projection, hs.columns


def token_id(model, token) -> int:
    return token if isinstance(token, int) else model.tokenizer(token, add_special_tokens=False)["input_ids"][0]


def hooked_logit(model, prompt: str, layer: int, path: str, edit, target=TARGET, contrast=CONTRAST) -> float:
    """The logit difference at the last token of ``prompt`` alone, in a plain transformers forward with
    ``edit(x)`` applied in place to the projection's input ``x [1, pos, in]`` by a torch forward pre-hook."""
    module = module_at(model.layers[layer], path)._module  # the torch module under nnterp's renamed path

    def pre_hook(_, args):
        x = args[0].clone()
        edit(x)
        return (x,) + tuple(args[1:])

    handle = module.register_forward_pre_hook(pre_hook)
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            logits = model._module(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits[0, -1]
    finally:
        handle.remove()
    logits = logits.float()[[token_id(model, target), token_id(model, contrast)]].double()
    cap = dla_recipes.plan.build_plan(model).softcap  # a soft-capped model: the parts sum to the logit before the cap
    if cap is not None:
        logits = cap * torch.atanh(logits / cap)
    return float(logits[0] - logits[1])


def projection_input(model, prompt: str, layer: int, path: str) -> torch.Tensor:
    """``[in]``: the projection's input at the last token of ``prompt`` alone, from a plain transformers forward."""
    seen = {}

    def keep(x):
        seen["x"] = x[0, -1].clone()

    hooked_logit(model, prompt, layer, path, keep)
    return seen["x"]


def assert_exact(attr, reference: torch.Tensor, rtol: float = 1e-4, bound: torch.Tensor | None = None):
    """The attribution's logit is the hooked forward's, and its parts sum to it, within ``rtol * max(1,
    |reference|)`` (the float32 promise) or, given, ``bound`` ``[prompts]``."""
    bound = rtol * torch.clamp(reference.abs(), min=1.0) if bound is None else bound
    assert torch.all((attr.logit - reference).abs() <= bound), (attr.logit, reference)
    assert torch.all((attr.total - reference).abs() <= bound), (attr.total, reference)


def ablate_fn(path: str, sl: slice):
    def ablate(model):
        module_at(model.layers[LAYER], path).input[:, :, sl] = 0
    return ablate


# -- ablate: zero one head, attribute the edited forward pass ------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_ablated_head_against_hooked_forward(family):
    model = tiny_model(family)
    path, sl = head_slice(model, LAYER, HEAD)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=ablate_fn(path, sl))

    def zero(x):
        x[..., sl] = 0

    reference = torch.tensor([hooked_logit(model, p, LAYER, path, zero) for p in PROMPTS])
    assert_exact(attr, reference)
    assert torch.all(attr.values[:, attr.labels.index(f"L{LAYER}.H{HEAD}")] == 0)  # exactly: its input is 0
    plain = torch.tensor([hooked_logit(model, p, LAYER, path, lambda x: None) for p in PROMPTS])
    assert (plain - reference).abs().max() > 1e-4, "the edit changed nothing: the test could not fail"


def test_ablated_head_bf16():
    """bf16, as NDIF serves: the logit is the hooked bf16 forward's, and the parts sum to it, within two bf16
    forwards' rounding."""
    from dla_recipes.testing import tiny

    model = dla_recipes.load(tiny.build("llama").to(torch.bfloat16), tokenizer=tiny.tokenizer())
    path, sl = head_slice(model, LAYER, HEAD)
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=ablate_fn(path, sl))

    def zero(x):
        x[..., sl] = 0

    reference = torch.tensor([hooked_logit(model, p, LAYER, path, zero) for p in PROMPTS])
    # two bf16 forwards (the padded batch, each prompt alone), each within the self-check's bound of its own
    # rounding (conftest.own_ratio's model): twice the bound, for the logit and the parts (measured before: parts
    # 1.4e-3 off at most, logits 0.2-0.3, seeds 0-2; the logit bit-equal here)
    assert_exact(attr, reference, bound=2 * attr.diagnostics["bound"])
    assert torch.all(attr.values[:, attr.labels.index(f"L{LAYER}.H{HEAD}")] == 0)


# -- patch: one head's output at the last token, from a corrupted prompt ------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_head_against_hooked_forward(family):
    model = tiny_model(family)
    path, sl = head_slice(model, LAYER, HEAD)
    corrupt = torch.stack([projection_input(model, p, LAYER, path)[sl] for p in CORRUPT])  # [batch, head_dim]

    def patch(m):
        module_at(m.layers[LAYER], path).input[:, -1, sl] = corrupt

    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=patch)

    def one(i):
        def edit(x):
            x[0, -1, sl] = corrupt[i]
        return edit

    reference = torch.tensor([hooked_logit(model, p, LAYER, path, one(i)) for i, p in enumerate(PROMPTS)])
    assert_exact(attr, reference)
    plain = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head")
    assert (plain.logit - attr.logit).abs().max() > 1e-4, "the patch changed nothing: the test could not fail"


@pytest.mark.parametrize("family", ["llama", "gemma2", "gptj"])
def test_steering_what_a_block_writes_is_exact(family):
    """A vector added to what block 0's MLP writes (at the last token) is attributed to L0.mlp: exact against a torch
    forward hook adding it; the same vector added to the stream between blocks is written by no component, and the
    self-check refuses it."""
    model = tiny_model(family)
    vector = torch.linspace(-2.0, 2.0, model.config.hidden_size)

    def steer(m):
        m.layers[0].mlp.output[:, -1] += vector

    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, intervene=steer)
    mlp = model.layers[0].mlp._module

    def add(_, args, out):
        out = out.clone()
        out[0, -1] += vector
        return out

    references = []
    for prompt in PROMPTS:
        handle = mlp.register_forward_hook(add)
        try:
            references.append(hooked_logit(model, prompt, 0, "mlp", lambda x: None))
        finally:
            handle.remove()
    assert_exact(attr, torch.tensor(references))
    plain = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST)
    assert (plain.logit - attr.logit).abs().max() > 1e-4, "the vector changed nothing: the test could not fail"

    def steer_stream(m):
        m.layers[0].output[:, -1] += vector

    with pytest.raises(dla_recipes.ExactnessError, match="adds to the residual stream itself"):
        dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, intervene=steer_stream)


def test_patch_in_one_trace_equals_intervene():
    """The documented clean/corrupt recipe: two invokes (corrupt, then clean: read the site, then assign), then
    trace_attribution over both; the clean rows equal attribute(intervene=) with the patched value put in."""
    model = tiny_model("llama")
    path, sl = head_slice(model, LAYER, HEAD)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(CORRUPT):
            corrupt = module_at(model.layers[LAYER], path).input[:, -1, sl]
        with tracer.invoke(PROMPTS):
            x = module_at(model.layers[LAYER], path).input
            x[:, -1, sl] = corrupt
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
    both = dla.result()
    assert both.prompts == tuple(CORRUPT + PROMPTS)
    value = torch.stack([projection_input(model, p, LAYER, path)[sl] for p in CORRUPT])

    def patch(m):
        module_at(m.layers[LAYER], path).input[:, -1, sl] = value

    alone = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=patch)
    # the same patched rows in another batch: both forwards' rounding of each row's logit (attribution_bound of
    # the unedited forward: the patch moves one head's input, the final norm's output keeps its scale)
    assert_rows_within(model, both[3:], alone, targets_of(model, alone), "patched")
    unedited = dla_recipes.attribute(model, CORRUPT, TARGET, contrast=CONTRAST, by="head", intervene=lambda m: None)
    assert_rows_within(model, both[:3], unedited, targets_of(model, unedited), "unedited")  # as above


# -- the in-trace call ----------------------------------------------------------------------------------------------


def test_trace_attribution_equals_intervene():
    model = tiny_model("gemma2")
    path, sl = head_slice(model, LAYER, HEAD)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS):
            module_at(model.layers[LAYER], path).input[:, :, sl] = 0
        with tracer.invoke():  # a second edit at an earlier block: its own invoke (one invoke reads in forward order)
            model.layers[0].mlp.output[:, -1] *= 1.5
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
    traced = dla.result()

    def both(m):  # the same two edits in forward order
        m.layers[0].mlp.output[:, -1] *= 1.5
        module_at(m.layers[LAYER], path).input[:, :, sl] = 0

    called = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=both)
    assert traced.labels == called.labels and traced.prompts == called.prompts
    assert traced.positions == called.positions == (5, 1, 3)
    # the same edited forward through two entry points: a float32 forward's rounding of each row's logit (as above)
    assert_rows_within(model, traced, called, targets_of(model, called), "traced")
    assert traced.error <= float(tolerance(traced.logit).min())
    assert list(traced.top(3).columns) == ["component", "value", "share"] and traced.to_frame().shape[1] == 3


def test_first_statement_of_a_direct_trace():
    """In ``model.trace(prompts)``, called first: it sees the edits written after it, as attribute(intervene=)."""
    model = tiny_model("olmo2")
    path, sl = head_slice(model, LAYER, HEAD)
    with torch.no_grad(), model.trace(PROMPTS) as tracer:
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
        model.layers[0].mlp.output[:, -1] *= 1.5
        module_at(model.layers[LAYER], path).input[:, :, sl] = 0
        logits = model.output.logits[:, -1].save()
    traced = dla.result()

    def both(m):
        m.layers[0].mlp.output[:, -1] *= 1.5
        module_at(m.layers[LAYER], path).input[:, :, sl] = 0

    called = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=both)
    assert_rows_within(model, traced, called, targets_of(model, called), "first")  # as above
    assert torch.all(traced.values[:, traced.labels.index(f"L{LAYER}.H{HEAD}")] == 0)
    own = logits[:, token_id(model, TARGET)] - logits[:, token_id(model, CONTRAST)]  # the edited trace's own output
    # the trace's own output against the logit read from it: one forward, two float32 reads of its logits
    assert batch_ratio(traced.output_logit, own.float(), attribution_bound(model, traced, targets_of(model, traced))) <= 1


def test_intervene_with_batches():
    model = tiny_model("llama")
    edit = ablate_fn(*head_slice(model, LAYER, HEAD))
    whole = dla_recipes.attribute(model, PROMPTS, TARGET, by="head", intervene=edit)
    chunked = dla_recipes.attribute(model, PROMPTS, TARGET, by="head", intervene=edit, batch_size=2)
    assert_rows_within(model, chunked, whole, targets_of(model, whole), "chunked")  # as above, another batching


def test_misuse_raises_trace_usage_error():
    model = tiny_model("llama")
    with pytest.raises(TraceUsageError, match="after the model started running"), model.trace() as tracer:  # noqa: SIM117
        with tracer.invoke(PROMPTS):
            model.layers[1].self_attn.o_proj.input[:, :, :4] = 0
            dla_recipes.trace_attribution(tracer, TARGET)
    with pytest.raises(TraceUsageError, match=r"as the first statement"), model.trace(PROMPTS) as tracer:
        model.layers[1].self_attn.o_proj.input[:, :, :4] = 0
        dla_recipes.trace_attribution(tracer, TARGET)
    with pytest.raises(TraceUsageError, match="running trace"):
        dla_recipes.trace_attribution(model, TARGET)
    with pytest.raises(TraceUsageError, match="no prompts yet"), model.trace() as tracer:
        dla_recipes.trace_attribution(tracer, TARGET)
        with tracer.invoke(PROMPTS):
            pass
    with pytest.raises(TraceUsageError, match="an invoke was added after it"), model.trace() as tracer:
        with tracer.invoke(PROMPTS[:1]):
            pass
        dla_recipes.trace_attribution(tracer, TARGET)
        with tracer.invoke(PROMPTS[1:]):
            pass
    with pytest.raises(dla_recipes.InputError, match="intervene must be a function"):
        dla_recipes.attribute(model, PROMPTS, TARGET, intervene="zero L1.H1")
    handle = dla_recipes.TracedAttribution(dla_recipes.plan.build_plan(model), "block", (), (), None, (), 1e-4)
    with pytest.raises(TraceUsageError, match="has not run yet"):
        handle.result()


# -- a real model ---------------------------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow  # loads SmolLM2 for this test alone: ~4 s of CPU
def test_smollm2_ablated_head():
    model = dla_recipes.load(models.default_model_path())
    prompt, layer, head = "The Eiffel Tower is in the city of", 29, 1
    path, sl = head_slice(model, layer, head)

    def ablate(m):
        module_at(m.layers[layer], path).input[:, :, sl] = 0

    attr = dla_recipes.attribute(model, prompt, " Paris", contrast=" Rome", by="head", intervene=ablate)

    def zero(x):
        x[..., sl] = 0

    reference = torch.tensor([hooked_logit(model, prompt, layer, path, zero, " Paris", " Rome")])
    assert_exact(attr, reference)
    assert float(attr.values[0, attr.labels.index(f"L{layer}.H{head}")]) == 0.0
    plain = hooked_logit(model, prompt, layer, path, lambda x: None, " Paris", " Rome")
    assert abs(plain - float(reference[0])) > 0.1  # the head matters: ablating it moves the logit difference


# -- remote: the edit travels with the request ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dla_recipes.testing import tiny
    from dla_recipes.testing.loopback import LoopbackServer

    folder = tmp_path_factory.mktemp("served") / "llama"
    tiny.build("llama").save_pretrained(folder)
    tiny.tokenizer().save_pretrained(folder)
    with LoopbackServer({"llama": str(folder)}, api_key=secrets.token_hex(16), forked=True) as running:
        yield running


def zero_l1h1(model):
    model.layers[1].self_attn.o_proj.input[:, :, 16:32] = 0


@pytest.mark.server
def test_remote_intervene_equals_local(server):
    remote_model, local_model = server.remote_model("llama"), server.local_model("llama")
    with server.client():
        remote = dla_recipes.attribute(remote_model, PROMPTS, TARGET, contrast=CONTRAST, by="head", remote=True,
                                       intervene=zero_l1h1)
    with single_threaded():
        local = dla_recipes.attribute(local_model, PROMPTS, TARGET, contrast=CONTRAST, by="head", intervene=zero_l1h1)
    assert remote.labels == local.labels
    # the same edited forward in two processes: each within a float32 forward's rounding of the row's logit
    # (attribution_bound of the unedited forward: the edit zeroes one head, the final norm's output keeps its scale)
    assert_rows_within(local_model, remote, local, targets_of(local_model, local), "remote intervene")
    assert torch.all(remote.values[:, remote.labels.index("L1.H1")] == 0)
    assert all(p.device.type == "meta" for p in remote_model._module.parameters())


@pytest.mark.server
def test_remote_trace_attribution_equals_local(server):
    remote_model, local_model = server.remote_model("llama"), server.local_model("llama")
    from dla_recipes import trace_attribution  # by name: a remote trace cannot ship the module object

    nnsight.register(dla_recipes)  # the server has no dla_recipes: the call in the block travels by value
    with server.client(), torch.no_grad(), remote_model.trace(remote=True) as tracer:
        with tracer.invoke(CORRUPT):
            corrupt = remote_model.layers[1].self_attn.o_proj.input[:, -1, 16:32]
        with tracer.invoke(PROMPTS):
            x = remote_model.layers[1].self_attn.o_proj.input
            x[:, -1, 16:32] = corrupt
        dla = trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
    remote = dla.result()
    with single_threaded(), torch.no_grad(), local_model.trace() as tracer:
        with tracer.invoke(CORRUPT):
            corrupt = local_model.layers[1].self_attn.o_proj.input[:, -1, 16:32]
        with tracer.invoke(PROMPTS):
            x = local_model.layers[1].self_attn.o_proj.input
            x[:, -1, 16:32] = corrupt
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
    local = dla.result()
    assert isinstance(remote, dla_recipes.Attribution) and remote.labels == local.labels
    assert remote.prompts == local.prompts == tuple(CORRUPT + PROMPTS)
    # the same patched forward in two processes: a float32 forward's rounding of each row's logit (as above)
    assert_rows_within(local_model, remote, local, targets_of(local_model, local), "remote trace")


@pytest.mark.server
def test_remote_first_statement_equals_local(server):
    """``model.trace(prompts, remote=True)`` with the call first, then an edit: the same on the server as locally."""
    from dla_recipes import trace_attribution

    nnsight.register(dla_recipes)
    results = []
    for model, remote in ((server.remote_model("llama"), True), (server.local_model("llama"), False)):
        with contextlib.ExitStack() as stack:
            stack.enter_context(server.client() if remote else single_threaded())
            with torch.no_grad(), model.trace(PROMPTS, remote=remote) as tracer:
                dla = trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
                model.layers[1].self_attn.o_proj.input[:, :, 16:32] = 0
        results.append(dla.result())
    remote, local = results
    # the same edited forward in two processes: a float32 forward's rounding of each row's logit (as above); the
    # local model of the loop, dispatched by its trace
    assert_rows_within(model, remote, local, targets_of(model, local))
    assert torch.all(remote.values[:, remote.labels.index("L1.H1")] == 0)
