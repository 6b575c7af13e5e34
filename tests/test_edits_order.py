"""The order of edits around ``trace_attribution`` (issue 22, item 4): patching across invokes.

nnsight serves the blocks waiting at a site in the order they were written, so the attribution (written last) reads
each site after the user's edits there, except for a block that arrives at the site while it is being served (one
released by a ``tracer.barrier``) or one written after the call. Each form a user writes to patch one prompt from
another is checked here against the model's own output: a plain transformers forward of each prompt alone, with the
same patch made by a torch forward hook (the patched value captured from a plain forward of the other prompt
alone). The forms that cannot work (a name used in one invoke before another invoke binds it) raise a
``TraceUsageError`` saying what works; the docs (``docs/api.md``, "Patching across invokes") show these forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import bounds
import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, plain_differences, tiny_model

import dla_recipes
from dla_recipes import TraceUsageError
from dla_recipes.plan import module_at
from dla_recipes.trace import order

CORRUPT = ["w30 w31 w32 w33 w34 w35", "w36 w37", "w38 w39 w40 w41"]  # one corrupted prompt per clean prompt
# llama-like; sandwich norms (the MLP's write passes a post-norm) and a soft-cap; a parallel block
FAMILIES = ["llama", "gemma2", "gptj"]
LAYER, HEAD = 1, 1
# |parts' sum - the hooked forward|: within both forwards' rounding of the logit difference (``References``:
# bounds.logit_rounding under the same hook, capped by the float32 promise; measured before: 2.9e-7 of max(1,
# |logit|) at most, gptj); before the fix the barrier cases were off by 0.016-0.087.


def token_id(model, token: str) -> int:
    return model.tokenizer(token, add_special_tokens=False)["input_ids"][0]


def difference(model, logits: torch.Tensor) -> float:
    """``logit(TARGET) - logit(CONTRAST)`` before any soft-cap, from a plain forward's last-token logits."""
    pair = logits.float()[[token_id(model, TARGET), token_id(model, CONTRAST)]].double()
    cap = dla_recipes.plan.build_plan(model).softcap
    if cap is not None:
        pair = cap * torch.atanh(pair / cap)
    return float(pair[0] - pair[1])


@dataclass
class References:
    """Each row's logit difference in a plain forward (``values`` ``[rows]``) and how far the parts may sum from it
    (``limits``: both forwards' rounding of it, bounds.logit_rounding with the same hook on, capped by the float32
    promise ``1e-4 * max(1, |value|)``)."""

    values: torch.Tensor
    limits: torch.Tensor

    @classmethod
    def of(cls, rows: list[tuple[float, float]]) -> References:
        return cls(torch.tensor([v for v, _ in rows], dtype=torch.float64),
                   torch.tensor([b for _, b in rows], dtype=torch.float64))


def reference(model, prompt: str, module=None, hook=None, pre=False) -> tuple[float, float]:
    """``(logit difference, its bound)`` of a plain forward of ``prompt`` alone with ``hook`` on ``module``
    (``References``)."""
    value = difference(model, forward(model, prompt, module, hook, pre))
    handle = None
    if module is not None:
        handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
    try:
        rounding = bounds.logit_rounding(model, model.tokenizer(prompt)["input_ids"])[-1]
    finally:
        if handle is not None:
            handle.remove()
    both = 2 * float(rounding[token_id(model, TARGET)] + rounding[token_id(model, CONTRAST)])
    return value, min(both, 1e-4 * max(1.0, abs(value)))


def forward(model, prompt: str, module=None, hook=None, pre=False) -> torch.Tensor:
    """``[vocab]``: the last-token logits of a plain transformers forward of ``prompt`` alone, with ``hook`` on the
    torch ``module`` for the call (a forward pre-hook with ``pre``)."""
    handle = None
    if module is not None:
        handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
    try:
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            return model._module(**ids).logits[0, -1]
    finally:
        if handle is not None:
            handle.remove()


def mlp(model):
    """The torch module under ``model.layers[LAYER].mlp``."""
    return model.layers[LAYER].mlp._module


def written(model):
    """The envoy whose output is what block ``LAYER``'s MLP adds to the stream, the site the attribution reads it at
    (Gemma-2: its post-norm; elsewhere the MLP itself)."""
    layer = model.layers[LAYER]
    return layer.post_feedforward_layernorm if hasattr(layer, "post_feedforward_layernorm") else layer.mlp


def captured(model, prompt: str, module, pre=False) -> torch.Tensor:
    """``[pos, ...]``: ``module``'s output (its input with ``pre``) in a plain forward of ``prompt`` alone."""
    seen = {}

    def keep(_, args, *output):
        value = args[0] if pre else output[0]
        seen["x"] = (value[0] if isinstance(value, tuple) else value)[0].clone()

    forward(model, prompt, module, keep, pre)
    return seen["x"]


def patched_references(model, module, last_only=True, pre=False, columns=slice(None)) -> References:
    """``[2 * batch]``: the logit differences of CORRUPT (unedited) then PROMPTS, each clean prompt with ``module``'s
    output (its input's ``columns`` with ``pre``) at its last token (every token: ``last_only=False``, equal lengths)
    replaced by the corrupted prompt's, by a torch hook on a plain forward of each prompt alone."""
    references = [reference(model, p) for p in CORRUPT]
    for clean, corrupt in zip(PROMPTS, CORRUPT):
        value = captured(model, corrupt, module, pre)

        def hook(_, args, *output, value=value):
            x = (args[0] if pre else output[0]).clone()
            if last_only:
                x[0, -1, columns] = value[-1, columns]
            else:
                x[0] = value
            return (x, *args[1:]) if pre else x

        references.append(reference(model, clean, module, hook, pre))
    return References.of(references)


def assert_sums_to(attr, references: References):
    """Each row's parts sum to the model's own (hooked) logit difference, within both forwards' rounding of it."""
    total = attr.values.double().sum(-1) + attr.constant.double()
    gaps = (total - references.values).abs()
    assert float((gaps / references.limits).max()) <= 1, (total.tolist(), references.values.tolist())


def assert_the_patch_changed_something(model, references: References):
    clean = torch.tensor(plain_differences(model, PROMPTS))
    changed = float((references.values[3:] - clean).abs().max())
    assert changed > 1e-3, "the patch changed nothing: the test could not fail"


# -- a tracer.barrier: the edit's block arrives at the site while it is served -------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("placement", ["after the invokes", "first statement"])
def test_a_barrier_patch_is_attributed_as_the_model_ran_it(family, placement):
    """The issue's case: a barrier pins the clean invoke's edit after the corrupted invoke's read. The edit's block
    is released while the site is being served, after the attribution was already waiting there; the attribution
    reads the site after it (it raised ExactnessError, blaming the family table)."""
    model = tiny_model(family)
    first = placement == "first statement"
    site = written(model)
    with torch.no_grad(), model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CORRUPT):
            if first:
                dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="neuron")
            h = site.output
            barrier()
        with tracer.invoke(PROMPTS):
            barrier()
            site.output[:, -1] = h[:, -1]
        if not first:
            dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="neuron")
    attr = dla.result()
    references = patched_references(model, site._module)
    assert_sums_to(attr, references)
    assert_the_patch_changed_something(model, references)


def test_a_barrier_patch_of_a_head_is_in_the_head():
    """A head's slice of o_proj's input patched through a barrier, by head: the head's part is read after the
    patch, so nothing of it is left for ``L1.attn.edit``. Before, the head's part was read before the patch and
    ``L1.attn.edit`` held the patch's whole share: the sum passed (off by 1e-7) and the attribution was wrong."""
    model = tiny_model("llama")
    hs = dla_recipes.head_slice(model, LAYER, HEAD)
    with torch.no_grad(), model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CORRUPT):
            h = hs.site(model).input[:, -1][hs.index]
            barrier()
        with tracer.invoke(PROMPTS):
            barrier()
            hs.site(model).input[:, -1][hs.index] = h
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
    attr = dla.result()
    projection = module_at(model.layers[LAYER], hs.projection)._module
    references = patched_references(model, projection, pre=True, columns=hs.columns)
    assert_sums_to(attr, references)
    assert_the_patch_changed_something(model, references)
    edit = attr.values[:, attr.labels.index(f"L{LAYER}.attn.edit")]
    limit = edit_bounds(model, projection, hs.columns)  # o_proj's float32 rounding only (edit_bounds)
    assert float((edit.abs() / limit).max()) <= 1, edit


def edit_bounds(model, projection, columns) -> torch.Tensor:
    """``[rows]`` (CORRUPT, then PROMPTS patched as ``patched_references`` patches them): how far ``L1.attn.edit``
    may be from 0 when the heads are read after the patch. Model: the column is what o_proj wrote beyond its heads'
    parts, read along the final norm's frozen direction ``c``: o_proj's own float32 output and the parts' products
    (``gamma_{d + n}`` of ``|c| |W_O| |o|`` each, ``o`` its input) and the read of its output (``bounds.dot_bound``)."""
    weight = projection.weight.detach().float()  # [d_model, n]
    rows = model._module.lm_head.weight.detach().float()
    norm = model._module.model.norm
    t, c = token_id(model, TARGET), token_id(model, CONTRAST)
    limits = []
    for clean, corrupt in [(p, None) for p in CORRUPT] + list(zip(PROMPTS, CORRUPT)):
        seen = {}
        handles = [norm.register_forward_hook(lambda m, a, out, seen=seen: seen.update(x=a[0][0, -1].float()))]
        if corrupt is not None:
            value = captured(model, corrupt, projection, pre=True)

            def patch(_, args, value=value):
                x = args[0].clone()
                x[0, -1, columns] = value[-1, columns]
                return (x, *args[1:])

            handles.append(projection.register_forward_pre_hook(patch))
        handles.append(projection.register_forward_hook(
            lambda m, a, out, seen=seen: seen.update(o=a[0][0, -1].float(), out=out[0, -1].float())))
        try:
            forward(model, clean)
        finally:
            for handle in handles:
                handle.remove()
        x = seen["x"]
        scale = torch.rsqrt(x.pow(2).mean() + norm.variance_epsilon)
        direction = scale * norm.weight.detach().float() * (rows[t] - rows[c])
        magnitude = float(direction.abs() @ weight.abs() @ seen["o"].abs())
        limits.append(2 * bounds.gamma(sum(weight.shape)) * magnitude + float(bounds.dot_bound(direction, seen["out"])))
    return torch.tensor(limits)


def test_an_invoke_written_after_the_call_is_attributed():
    """An empty invoke of edits written after ``trace_attribution`` (it adds no rows, so the call allows it) is
    served after the attribution at every site; the attribution now reads each site after it."""
    model = tiny_model("llama")
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS):
            pass
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
        with tracer.invoke():
            model.layers[0].mlp.output[:, -1] *= 1.5
    attr = dla.result()
    references = scaled_references(model)
    assert_sums_to(attr, references)
    assert float((references.values - torch.tensor(plain_differences(model, PROMPTS))).abs().max()) > 1e-3


def scaled_references(model) -> References:
    """``[batch]``: PROMPTS' logit differences with block 0's MLP output at the last token times 1.5 (a torch
    forward hook on a plain forward of each prompt alone)."""

    def scale(_, args, output):
        output = output.clone()
        output[0, -1] *= 1.5
        return output

    return References.of([reference(model, p, model.layers[0].mlp._module, scale) for p in PROMPTS])


def test_two_attributions_in_one_trace_both_read_after_the_edits():
    """Two ``trace_attribution`` calls in one trace: each waits for the user's blocks at a site, not for the other
    (which would leave both waiting)."""
    model = tiny_model("llama")
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS):
            model.layers[0].mlp.output[:, -1] *= 1.5
        heads = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
        neurons = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="neuron")
    references = scaled_references(model)
    assert_sums_to(heads.result(), references)
    assert_sums_to(neurons.result(), references)


def test_an_attribution_that_cannot_wait_names_the_site(monkeypatch):
    """Where the trace's driver cannot make the attribution wait (here: no rounds allowed), the site it read before
    the edit is named, with the order to use, instead of a sum that blames the family table."""
    monkeypatch.setattr(order, "WAITS", 0)
    model = tiny_model("llama")
    with torch.no_grad(), model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(CORRUPT):
            h = model.layers[LAYER].mlp.output
            barrier()
        with tracer.invoke(PROMPTS):
            barrier()
            model.layers[LAYER].mlp.output[:, -1] = h[:, -1]
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST)
    with pytest.raises(TraceUsageError, match=rf"read \S*layers\.{LAYER}\.mlp\.output before your edit of it: the "
                                              r"block editing rows 3-5 .* Put every edit before the attribution"):
        dla.result()


# -- the forms that work, as docs/api.md shows them ----------------------------------------------------------------


def patch_in_place(model, tracer):
    with tracer.invoke(CORRUPT):  # the invoke that reads the value, first
        h = model.layers[1].mlp.output
    with tracer.invoke(PROMPTS):  # read the site, then edit it in place
        x = model.layers[1].mlp.output
        x[:, -1] = h[:, -1]


def one_invoke(model, tracer):
    with tracer.invoke(CORRUPT + PROMPTS):  # one tensor holds both prompts' rows
        x = model.layers[1].mlp.output
        x[3:, -1] = x[:3, -1]


@pytest.mark.parametrize("form", [patch_in_place, one_invoke], ids=lambda f: f.__name__)
def test_the_documented_patch_forms_are_exact(form):
    model = tiny_model("llama")
    with torch.no_grad(), model.trace() as tracer:
        form(model, tracer)
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
    attr = dla.result()
    references = patched_references(model, mlp(model))
    assert_sums_to(attr, references)
    assert_the_patch_changed_something(model, references)


def test_the_first_statement_of_the_editing_invoke_is_exact():
    model = tiny_model("llama")
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(CORRUPT):
            h = model.layers[1].mlp.output
        with tracer.invoke(PROMPTS):
            dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="head")
            x = model.layers[1].mlp.output
            x[:, -1] = h[:, -1]
    attr = dla.result()
    references = patched_references(model, mlp(model))
    assert_sums_to(attr, references)
    assert_the_patch_changed_something(model, references)


def test_a_whole_output_swap_after_reading_the_site_is_exact():
    """``site`` alone on a line, then ``site = h``: the read waits for the site, the assignment swaps it (prompts of
    one length, so the whole output of a row is the prompt's own)."""
    model = tiny_model("llama")
    clean, corrupt = ["w11 w12 w13", "w5 w6 w7"], ["w36 w37 w38", "w30 w31 w32"]
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(corrupt):
            h = model.layers[1].mlp.output
        with tracer.invoke(clean):
            model.layers[1].mlp.output  # noqa: B018 (wait for the site before using h)
            model.layers[1].mlp.output = h
        dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, by="neuron")
    attr = dla.result()
    rows = [reference(model, p) for p in corrupt]
    for prompt, source in zip(clean, corrupt):
        value = captured(model, source, mlp(model))
        rows.append(reference(model, prompt, mlp(model), lambda *_, v=value: v[None]))
    references = References.of(rows)
    assert_sums_to(attr, references)
    assert float((references.values[2:] - torch.tensor(plain_differences(model, clean))).abs().max()) > 1e-3


# -- the forms that cannot work: a name used before the invoke that binds it has run ------------------------------


def assign_at_once(model, tracer):
    with tracer.invoke(CORRUPT):
        h = model.layers[1].mlp.output
    with tracer.invoke(PROMPTS):
        model.layers[1].mlp.output = h  # evaluates h before waiting for the site


def earlier_site_first(model, tracer):
    with tracer.invoke(CORRUPT):
        h = model.layers[1].mlp.output
    with tracer.invoke(PROMPTS):
        model.layers[1].self_attn.output  # noqa: B018 (waits at an earlier site: h is used there)
        model.layers[1].mlp.output[:, -1] = h[:, -1]


def source_written_after(model, tracer):
    with tracer.invoke(PROMPTS):
        x = model.layers[1].mlp.output
        x[:, -1] = h[:, -1]  # noqa: F821 (bound by the invoke below, which is served after this one)
    with tracer.invoke(CORRUPT):
        h = model.layers[1].mlp.output  # noqa: F841


@pytest.mark.parametrize("form", [assign_at_once, earlier_site_first, source_written_after],
                         ids=lambda f: f.__name__)
def test_a_name_another_invoke_binds_is_a_trace_usage_error(form):
    """The natural cross-invoke assignment raised a bare ``NameError`` (after ~70 lines of the model's traceback
    when it happened mid-forward): it now says what works."""
    model = tiny_model("llama")
    rows = "rows 0-2" if form is source_written_after else "rows 3-5"
    says = rf"`h` is not defined yet where the invoke of {rows} uses it: .*x = site` then `x\[:, -1\] = h\[:, -1\]"
    with pytest.raises(TraceUsageError, match=says), torch.no_grad(), model.trace() as tracer:
        form(model, tracer)
        dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST)


def test_a_name_no_invoke_binds_stays_a_name_error():
    model = tiny_model("llama")
    with pytest.raises(NameError) as raised, torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS):
            model.layers[1].mlp.output[:, -1] = undefined_name  # noqa: F821
        dla_recipes.trace_attribution(tracer, TARGET)
    assert not isinstance(raised.value, TraceUsageError)
