"""The verb x option matrix: every public verb with every keyword option, each cell against the MODEL'S OWN output.

Rows are the six verbs (``attribute``, ``attribute_direction``, ``attribute_generation``, ``attribute_scores``,
``attribute_dataset``, ``trace_attribution``); columns the options every verb takes (``dla_recipes.question``):
``by``, ``dictionaries``, ``by="source"`` + ``sources``, ``intervene``, ``check="adds"``, ``tolerance``,
``reduce="sum"``, ``reduce="stats"``, ``batch_size``, ``fast=False``, ``remote`` and ``blocking=False``. The cells
are the product of the two lists; a pair in ``question.REFUSED`` must raise ``InputError`` carrying REFUSED's
reason, every other pair must run and be exact:

- ``attribute`` / ``attribute_dataset`` / ``trace_attribution``: each site's parts (plus the constant) and its
  logit are a plain transformers forward of the prompt alone (``test_positions.own_logits``), hooked with a torch
  forward hook making the same edit where the forward is edited (``trace_attribution``: always, the edit is the
  user's own code in the trace);
- ``attribute_direction``: the direction dotted with the norm's own output (a torch hook on the norm module);
- ``attribute_generation``: the answer is transformers' own ``generate`` (under the same hook, each prompt alone and
  ``use_cache=False`` when edited), each step's parts the plain forward of prompt + answer alone;
- ``attribute_scores``: ``test_scores.check_against_eager`` (the eager attention weights and the attention call's
  own ``q . k * scaling``), hooked where edited;
- ``dictionaries=``: every latent's part, the decoder bias and the error also equal ``test_features.reference``
  (the dictionary's own encode / decode on plainly hooked activations);
- ``check="adds"``: a healthy call runs, and a hidden 1% write (a torch hook on block 0's output for the whole
  call) raises ``ExactnessError`` naming block 0;
- ``tolerance``: the self-check's bound is ``tolerance * max(1, |logit|)``; ``batch_size=2``: the model ran a
  batch of 2 then 1 (a hook on the transformers module counts them);
- ``remote`` / ``blocking=False``: on the loopback server (``@pytest.mark.server``), the same checks, and remote
  equals local.

Each cell runs on tiny llama; the other family of each group (``conftest.FAST_FAMILIES``) is spread over the cells
(``spread``), each family meeting several verbs and options. No reference uses the package's arithmetic.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from conftest import CONTRAST, FAST_FAMILIES, PROMPTS, TARGET, eager_model, serve_tiny, single_threaded, tiny_model
from test_features import D_SAE, calibrated, make, reference
from test_generation import plain_generate
from test_positions import ids_of, own_logits
from test_scores import check_against_eager

import dla_recipes
from dla_recipes import ExactnessError, InputError
from dla_recipes.plan import build_plan, module_at
from dla_recipes.question import REFUSED, ask
from dla_recipes.transport.handle import RemoteJob

# -- the matrix: two short lists and their product, filtered by REFUSED ----------------------------------------------

VERBS = ("attribute", "attribute_direction", "attribute_generation", "attribute_scores", "attribute_dataset",
         "trace_attribution")
OPTIONS = ("by", "dictionaries", "sources", "intervene", "check", "tolerance", "reduce_sum", "reduce_stats",
           "batch_size", "fast", "remote", "blocking")
REMOTE = ("remote", "blocking")  # run on the loopback server


def field(option: str) -> str:
    """The ``Question`` field a column sets (``reduce_sum`` -> ``reduce``)."""
    return option.split("_")[0] if option.startswith("reduce") else option


def refusal(verb: str, option: str) -> str | None:
    """REFUSED's reason for the cell: its ``(verb, option)`` entry, or its ``(verb, option, value)`` one
    (``reduce_stats``: ``("trace_attribution", "reduce", "stats")``)."""
    value = option.split("_", 1)[1] if option.startswith("reduce_") else None
    return REFUSED.get((verb, field(option))) or REFUSED.get((verb, field(option), value))


def refused(verb: str, option: str) -> bool:
    return refusal(verb, option) is not None


CELLS = list(itertools.product(VERBS, OPTIONS))
REFUSED_CELLS = [c for c in CELLS if refused(*c)]
LOCAL_CELLS = [c for c in CELLS if not refused(*c) and c[1] not in REMOTE]
REMOTE_CELLS = [c for c in CELLS if not refused(*c) and c[1] in REMOTE]

# Cells the package refuses OUTSIDE ``REFUSED`` (an InputError raised deep in the verb, after ask() passed it): the
# matrix says such a cell must run or carry REFUSED's reason, so each is a strict xfail, a bug reported.
DEEP: dict = {}

BY = {"attribute": "neuron", "attribute_direction": "neuron", "attribute_dataset": "neuron",
      "attribute_generation": "head", "attribute_scores": "head", "trace_attribution": "head"}
LAYER = 1  # the steered / dictionary MLP
STOP = 2  # attribute_direction's block (the norm in front of its MLP)
HEAD = "L2.H0"  # attribute_scores' head: it reads what L1.mlp wrote
KEYS = [0, -2]
STEPS = 3
TOL = 1e-3
PROMISE = 1e-4  # the float32 promise: the parts sum to the model's own value within 1e-4 * max(1, |value|)
HIDDEN = 0.01  # the hidden write's size, of the stream's median norm at block 0's output


def spread(families, cells) -> list[tuple[str, str, str]]:
    """``(family, verb, option)``: every cell on tiny llama, and each other family of ``families`` on the cells in
    turn (cell ``k`` with family ``k mod n``), so each family meets about ``len(cells) / n`` cells, verbs and options
    mixed. (``conftest.cover`` gives every ``FAST_FAMILIES`` member every option: the full product here.)"""
    others = [f for f in families if f != "llama"]
    return [("llama", *c) for c in cells] + [(others[k % len(others)], *c) for k, c in enumerate(cells)]


# cells whose reference reads a family-specific part beyond the MLP's write and the norms: llama only
LLAMA_ONLY = {"sources", "dictionaries"}
FAMILY_CASES = [c for c in spread(FAST_FAMILIES, [c for c in LOCAL_CELLS if c[0] != "attribute_scores"])
                if c[0] == "llama" or c[2] not in LLAMA_ONLY]
FAMILY_CASES += [("llama", v, o) for v, o in LOCAL_CELLS if v == "attribute_scores"]


def marks(verb, option) -> tuple:
    reason = DEEP.get((verb, option))
    raises = IndexError if option == "reduce_sum" else InputError
    return (pytest.mark.xfail(strict=True, raises=raises, reason=reason),) if reason else ()


# -- references: plain transformers with torch hooks -------------------------------------------------------------------


def steering_vector(model) -> torch.Tensor:
    d = int(model.lm_head.weight.shape[-1])
    return 0.5 * torch.randn(d, generator=torch.Generator().manual_seed(3))


def steer_fn(vector):
    """``intervene=``: ``vector`` added to block 1's MLP output at every position (nnsight)."""
    def steer(m, vector=vector):
        m.layers[1].mlp.output = m.layers[1].mlp.output + vector
    return steer


def add_hook(vector, position=None):
    """A torch forward hook adding ``vector`` to a module's output (at absolute ``position``, or everywhere)."""
    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        out = out.clone()
        if position is None:
            out = out + vector.to(out.dtype)
        else:
            out[:, position] += vector.to(out.dtype)
        return (out, *output[1:]) if isinstance(output, tuple) else out
    return hook


@contextlib.contextmanager
def hooked(module, hook):
    """``hook`` registered on ``module`` (a torch module) while inside; ``hook=None``: nothing."""
    handle = None if hook is None else module.register_forward_hook(hook)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def mlp_module(model):
    """The torch module nnterp calls ``layers[1].mlp`` (what ``steer_fn`` edits)."""
    return model.layers[LAYER].mlp._module


def term_module(model, layer=LAYER):
    """The torch module whose output is block ``layer``'s MLP term (the family table's write: the MLP, or its
    post-norm), what an ``"L1.mlp"`` dictionary reads."""
    term = next(p.term for p in build_plan(model).layers[layer] if p.term.name == "mlp")
    return module_at(model.layers[layer], term.output.rsplit(".", 1)[0])._module


def norm_module(model, layer=STOP):
    """The norm in front of block ``layer``'s MLP (the family table's ``reads``)."""
    term = next(p.term for p in build_plan(model).layers[layer] if p.term.name == "mlp")
    return module_at(model.layers[layer], term.reads)._module


@contextlib.contextmanager
def edited(model, edit: bool):
    """The edit ``steer_fn`` makes, made by a torch hook on the plain module (``edit=False``: none)."""
    with hooked(mlp_module(model), add_hook(steering_vector(model)) if edit else None):
        yield


def read(model, ids, modules: dict, position: int = -1) -> dict:
    """A plain forward of ``ids`` alone with torch hooks: ``{name_in, name_out}`` of each module at ``position``
    (float64)."""
    got, handles = {}, []
    for name, module in modules.items():
        def hook(mod, args, output, name=name):
            got[name + "_in"] = (args[0] if args else None)[0, position].double()
            got[name + "_out"] = (output[0] if isinstance(output, tuple) else output)[0, position].double()
        handles.append(module.register_forward_hook(hook))
    try:
        ids = torch.tensor([list(ids)])
        with torch.no_grad():
            model._module(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    return got


def frozen(norm, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w`` on a norm's output, pulled back to its input with the norm's scale frozen at its input ``x`` (its own
    output ``y``): a LayerNorm by its formula, an RMSNorm by its own ratio ``y / x`` channel by channel."""
    if isinstance(norm, torch.nn.LayerNorm):
        s = 1.0 / torch.sqrt(x.var(unbiased=False) + norm.eps)
        gw = norm.weight.detach().double() * w
        return s * (gw - gw.mean())
    return w * (y / x)


def token(model, text) -> int:
    return text if isinstance(text, int) else model.tokenizer.convert_tokens_to_ids(text)


def unembed(model, target, contrast=None) -> torch.Tensor:
    W = model._module.get_output_embeddings().weight.detach().double()
    return W[token(model, target)] - (W[token(model, contrast)] if contrast is not None else 0)


_DICTS: dict = {}


def dictionary_for(model):
    """A ReLU dictionary written in ``test_features`` (``Plain``: its own encode / decode) on block 1's MLP write,
    calibrated on its activations over every position of the prompts (about a fifth of the latents fire)."""
    if id(model) not in _DICTS:
        seen = []
        with hooked(term_module(model), lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out)[0])):
            for prompt in PROMPTS:
                own_logits(model, prompt)
        x = torch.cat(seen).detach()
        _DICTS[id(model)] = (model, calibrated(make("plain", x.shape[-1]), x, "plain"))
    return _DICTS[id(model)][1]


def check_latents(model, row: torch.Tensor, labels, ids, target, contrast=None, norm=None, direction=None,
                  edit=False, what="") -> int:
    """The columns of ``"L1.mlp"``'s latents, bias and error at the last position of ``ids`` against
    ``test_features.reference``: the dictionary's own encode / decode on the term's write (a hooked plain forward of
    ``ids`` alone), along the target's direction pulled back through the norm that reads it (the final norm, or
    ``norm`` with ``direction`` for ``attribute_direction``). Returns how many latents fired."""
    sae = dictionary_for(model)
    reads = {"w": term_module(model), "final": model.ln_final._module if norm is None else norm}
    with edited(model, edit):
        got = read(model, ids, reads)
    w = unembed(model, target, contrast) if norm is None else direction.double()
    v = frozen(reads["final"], got["final_in"], got["final_out"], w)
    ref = reference(sae, got["w_out"], got["w_out"], v)
    labels = list(labels)
    F = row[[labels.index(f"L1.mlp.F{i}") for i in range(D_SAE)]].double()
    assert bool(((F - ref["F"]).abs() <= ref["F_tol"] + 1e-300).all()), (what, float((F - ref["F"]).abs().max()))
    for name in ("bias", "error"):
        value = float(row[labels.index(f"L1.mlp.{name}")])
        assert abs(value - ref[name]) <= ref[f"{name}_tol"], (what, name, value, ref[name])
    return int((F != 0).sum())


def stream_norm(model) -> float:
    """The median norm of the stream leaving block 0 over the prompts' positions (a plain forward, hooked)."""
    seen = []
    with hooked(model.layers[0]._module, lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out)[0])):
        for prompt in PROMPTS:
            own_logits(model, prompt)
    return float(torch.cat(seen).float().norm(dim=-1).median())


def hidden_write(model, size=HIDDEN):
    """A torch forward hook adding ``size`` of the stream's norm to block 0's output (a write no component made)."""
    v = torch.randn(int(model.lm_head.weight.shape[-1]), generator=torch.Generator().manual_seed(5))
    return add_hook(size * stream_norm(model) * v / v.norm())


@contextlib.contextmanager
def batches_of(model, seen: list):
    """Record the batch size of every forward of the transformers module while inside."""
    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen.append(int(ids.shape[0]))
    handle = model._module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def within(got: float, want: float, what, scale=None) -> None:
    limit = PROMISE * (max(1.0, abs(want)) if scale is None else scale)
    assert abs(got - want) <= limit, f"{what}: {got} against the model's own {want} (limit {limit:.3g})"


def assert_model_values(result, wants: list[list[float]], reduce, what="") -> None:
    """``result``'s parts (and logit) against the model's own values ``wants`` (per prompt, its attributed sites in
    order): rows, sites of a ``PositionAttribution``, one sum a prompt (``reduce="sum"``), or statistics (the count,
    the mean logit and the mean parts + constant over every site)."""
    if reduce == "stats":
        every = [w for row in wants for w in row]
        assert result.count == len(every), (what, result.count, len(every))
        assert len(result.mean) == len(result.labels) + 2  # the components, then the constant and the logit
        mean = sum(every) / len(every)
        scale = max(max(1.0, abs(w)) for w in every)
        within(float(result.mean[-1]), mean, (what, "mean logit"), scale)
        within(float(result.mean[:-1].double().sum()), mean, (what, "mean parts + constant"), scale)
        return
    assert len(result.labels) == result.values.shape[-1] and len(set(result.labels)) == len(result.labels), what
    if hasattr(result, "mask"):
        for b, row in enumerate(wants):
            assert int(result.mask[b].sum()) == len(row), (what, b)
            for k, want in enumerate(row):
                within(float(result.values[b, k].double().sum() + result.constant[b, k].double()), want, (what, b, k))
                within(float(result.logit[b, k]), want, (what, b, k, "logit"))
        return
    for b, row in enumerate(wants):
        want = sum(row)
        scale = sum(max(1.0, abs(w)) for w in row)
        within(float(result.values[b].double().sum() + result.constant[b].double()), want, (what, b), scale)
        within(float(result.logit[b]), want, (what, b, "logit"), scale)


def options(verb: str, option: str, model) -> dict:
    """The keyword options of a cell (``reduce="sum"`` attributes every position, so the sum has several)."""
    made = {"by": lambda: {"by": BY[verb]},
            "dictionaries": lambda: {"dictionaries": {"L1.mlp": dictionary_for(model).dictionary()}},
            "sources": lambda: {"by": "source", "sources": {"layers": [1]}},
            "intervene": lambda: {"intervene": steer_fn(steering_vector(model))},
            "check": lambda: {"check": "adds"},
            "tolerance": lambda: {"tolerance": TOL},
            "reduce_sum": lambda: {"reduce": "sum"},
            "reduce_stats": lambda: {"reduce": "stats"},
            "batch_size": lambda: {"batch_size": 2},
            "fast": lambda: {"fast": False},
            "remote": lambda: {"remote": True},
            "blocking": lambda: {"remote": True, "blocking": False},
            "none": dict}
    return made[option]()


# -- the verbs, each with its reference ----------------------------------------------------------------------------


def finished(result):
    """A ``RemoteJob`` (``blocking=False``) waited on; anything else as it is."""
    return result.result(timeout=120) if isinstance(result, RemoteJob) else result


def attribute_case(model, ref, option, extra, plain=False):
    """``attribute``: each prompt's site(s) against the plain (hooked) forward's logit difference."""
    kw = options("attribute", option, ref) | extra
    position = "all" if option == "reduce_sum" else -1
    call = lambda: finished(dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, position=position,
                                                   progress=False, **kw))
    edit = option == "intervene" and not plain
    t, c = token(ref, TARGET), token(ref, CONTRAST)
    with edited(ref, edit):
        z = [own_logits(ref, p) for p in PROMPTS]
    wants = [[float(zb[p, t] - zb[p, c]) for p in (range(len(zb)) if position == "all" else [len(zb) - 1])]
             for zb in z]
    return call, wants, lambda attr, b: (ids_of(ref, PROMPTS[b]), TARGET, CONTRAST, attr.values[b])


def direction_case(model, ref, option, extra, plain=False):
    """``attribute_direction`` at block 2's MLP norm: the norm's own output (a torch hook) along the direction."""
    kw = options("attribute_direction", option, ref) | extra
    position = "all" if option == "reduce_sum" else -1
    v = torch.randn(int(ref.lm_head.weight.shape[-1]), generator=torch.Generator().manual_seed(0))
    call = lambda: finished(dla_recipes.attribute_direction(model, PROMPTS, v, layer=STOP, sublayer="mlp",
                                                             position=position, progress=False, **kw))
    norm = norm_module(ref)
    wants = []
    for prompt in PROMPTS:
        seen = []
        with edited(ref, option == "intervene" and not plain), hooked(norm, lambda m, a, out, seen=seen: seen.append(out[0].double())):
            own_logits(ref, prompt)
        y = seen[0] @ v.double()
        wants.append([float(x) for x in (y if position == "all" else y[-1:])])
    return call, wants, lambda attr, b: (ids_of(ref, PROMPTS[b]), None, None, attr.values[b], norm, v)


def generated_reference(ref, edit: bool, position=None, steps=STEPS, texts=PROMPTS):
    """Transformers' own greedy answers (``plain_generate``; edited: under the hook, each prompt alone, without the
    KV cache, as ``attribute_generation(intervene=)`` runs), cut after an EOS."""
    prompts = [ids_of(ref, p) for p in texts]
    eos = ref._module.generation_config.eos_token_id
    if not edit:
        tokens, _ = plain_generate(ref, prompts, steps)
    else:
        tokens = []
        with hooked(mlp_module(ref), add_hook(steering_vector(ref), position)):
            for p in prompts:
                tokens.append(plain_generate(ref, [p], steps, use_cache=False)[0][0])
    return prompts, [t[:t.index(eos) + 1] if eos in t else t for t in tokens]


def generation_case(model, ref, option, extra, plain=False):
    """``attribute_generation``: the answers are transformers' generate's, each step's parts the plain (hooked)
    forward of prompt + answer alone at the step's predicting position (the generated token's logit)."""
    kw = options("attribute_generation", option, ref) | extra
    call = lambda: finished(dla_recipes.attribute_generation(model, PROMPTS, STEPS, progress=False, **kw))
    edit = option == "intervene" and not plain
    prompts, answers = generated_reference(ref, edit)
    wants = []
    with edited(ref, edit):
        for p, a in zip(prompts, answers):
            z = own_logits(ref, p + a)
            wants.append([float(z[len(p) - 1 + k, t]) for k, t in enumerate(a)])

    def latents_at(attr, b):  # the last step: prompt + answer[:k] alone, its last position predicts answer[k]
        k = len(answers[b]) - 1
        return prompts[b] + answers[b][:k], answers[b][k], None, attr.values[b, k]

    return call, wants, latents_at, answers


def dataset_case(model, ref, option, extra, plain=False):
    """``attribute_dataset`` over the prompts as rows: the rows are ``attribute_case``'s (the model's own)."""
    kw = options("attribute_dataset", option, ref) | extra
    position = "all" if option == "reduce_sum" else -1
    rows = [{"prompt": p, "target": TARGET, "contrast": CONTRAST} for p in PROMPTS]
    call = lambda: finished(dla_recipes.attribute_dataset(model, rows, target="target", contrast="contrast",
                                                          position=position, progress=False, **kw))
    _, wants, latents = attribute_case(model, ref, option, {}, plain)
    return call, wants, latents


def trace_case(model, ref, option, extra, plain=False):
    """``trace_attribution`` in the user's own trace, after the user's edit (the steering vector, in its own
    invoke): the plain forward under the same edit by a torch hook."""
    kw = options("trace_attribution", option, ref) | extra
    position = "all" if option == "reduce_sum" else -1
    vector = steering_vector(ref)

    def call():
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS):
                model.layers[1].mlp.output = model.layers[1].mlp.output + vector
            dla = dla_recipes.trace_attribution(tracer, TARGET, contrast=CONTRAST, position=position, **kw)
        return dla.result()

    t, c = token(ref, TARGET), token(ref, CONTRAST)
    with edited(ref, not plain):
        z = [own_logits(ref, p) for p in PROMPTS] if padding_safe(ref) else batch_logits(ref, PROMPTS)
    wants = [[float(zb[p, t] - zb[p, c]) for p in (range(len(zb)) if position == "all" else [len(zb) - 1])]
             for zb in z]
    return call, wants, lambda attr, b: (ids_of(ref, PROMPTS[b]), TARGET, CONTRAST, attr.values[b])


def padding_safe(model) -> bool:
    return dla_recipes.families.family_of(model._module.config).padding_safe


def batch_logits(model, prompts) -> list[torch.Tensor]:
    """Each prompt's ``[pos, vocab]`` float64 logits (soft-cap undone) in a plain transformers forward of the padded
    batch, as the user's own trace runs it (the tokenizer pads; its attention mask and position ids): a padding-unsafe family's
    own output in that batch, each prompt's own positions."""
    encoding = dict(model.tokenizer(prompts, padding=True, return_tensors="pt"))
    # the position ids nnsight's LanguageModel passes with a left-padded batch (each prompt's own, from 0)
    encoding["position_ids"] = (encoding["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        y = model._module(**encoding).logits.double()
    cap = build_plan(model).softcap
    if cap is not None:
        y = cap * torch.atanh(y / cap)
    out = []
    for b in range(len(prompts)):
        own = encoding["attention_mask"][b].bool()
        out.append(y[b][own])
    return out


CASES = {"attribute": attribute_case, "attribute_direction": direction_case, "attribute_generation": generation_case,
         "attribute_dataset": dataset_case, "trace_attribution": trace_case}


def run_cell(verb, option, model, ref, extra=None):
    """Run the cell and hold it to the model's own output (``ref``: the same weights, local); returns the result."""
    extra = extra or {}
    what = (verb, option, build_plan(ref).family.name)
    made = CASES[verb](model, ref, option, extra)
    call, wants, latents = made[:3]
    hook = hidden_write(ref) if option == "check" and not extra else None
    seen: list = []
    with batches_of(ref, seen):
        result = call()
    reduce = {"reduce_sum": "sum", "reduce_stats": "stats"}.get(option)
    assert_model_values(result, wants, reduce, what)
    if verb == "attribute_generation" and reduce is None:
        assert [list(a) for a in result.generation.answers] == made[3], what
    if option == "by":
        assert any((".N" if BY[verb] == "neuron" else ".H") in label for label in result.labels), what
    if option == "sources":
        assert any(".S0" in label for label in result.labels), what
    if option == "tolerance":
        bound = result.diagnostics["bound"].double()
        assert torch.allclose(bound, TOL * result.logit.double().abs().clamp(min=1.0), rtol=1e-6, atol=0), what
    if option == "batch_size" and not extra:
        assert max(seen) == 2 and 2 in seen and (verb == "attribute_generation" or seen == [2, 1]), (what, seen)
    if option == "intervene" or verb == "trace_attribution":  # the edit moved the model's output: it can fail
        plain = CASES[verb](ref, ref, option, {}, plain=True)[1]
        assert max(abs(a - b) for x, y in zip(plain, wants) for a, b in zip(x, y)) > 1e-3, what
    if option == "dictionaries":
        active = 0
        for b in range(len(PROMPTS)):
            args = latents(result, b)
            norm, direction = (args[4], args[5]) if len(args) > 4 else (None, None)
            active += check_latents(ref, args[3], result.labels, args[0], args[1], args[2], norm, direction,
                                    edit=verb == "trace_attribution", what=(*what, b))
        assert 0 < active < D_SAE * len(PROMPTS), (what, active)
    if hook is not None:  # the same call with a hidden write at block 0's output, for the whole call
        with hooked(ref.layers[0]._module, hook), pytest.raises(ExactnessError, match="block 0's"):
            call()
    return result


@pytest.mark.parametrize(("family", "verb", "option"),
                         [pytest.param(f, v, o, marks=marks(v, o)) for f, v, o in FAMILY_CASES])
def test_cell_is_the_models_own(family, verb, option):
    if verb == "attribute_scores":
        scores_cell(eager_model(family), eager_model(family), option)
        return
    model = tiny_model(family)
    run_cell(verb, option, model, model)


def scores_cell(model, ref, option, extra=None):
    """``attribute_scores`` of ``HEAD``: ``test_scores.check_against_eager`` (the eager weights' log differences and
    the attention call's own ``q . k * scaling``, each prompt alone), under the torch hook where edited."""
    extra = extra or {}
    kw = options("attribute_scores", option, ref) | extra
    seen: list = []
    with batches_of(ref, seen):
        attr = finished(dla_recipes.attribute_scores(model, PROMPTS, HEAD, keys=KEYS, progress=False, **kw))
    layer, head = (int(x[1:]) for x in HEAD.split("."))
    with edited(ref, option == "intervene"):
        ratios = check_against_eager(ref, attr, layer, head)
    assert max(ratios) <= 1, (option, ratios)
    if option == "intervene":  # the edit moved the score: the check could fail
        plain = dla_recipes.attribute_scores(ref, PROMPTS, HEAD, keys=KEYS)
        assert float((plain.score - attr.score).abs().max()) > 1e-3
    if option == "tolerance":
        assert torch.allclose(attr.diagnostics["bound"], TOL * attr.score.abs().clamp(min=1.0), rtol=1e-6, atol=0)
    if option == "batch_size" and not extra:
        assert seen == [2, 1], seen
    return attr


# -- the refused cells: InputError carrying REFUSED's reason ---------------------------------------------------------


def call_verb(verb, model, **kw):
    """``verb`` called on the prompts with ``kw`` (``trace_attribution``: inside the user's own trace)."""
    if verb == "trace_attribution":
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPTS):
                pass
            dla_recipes.trace_attribution(tracer, TARGET, **kw)
        return None
    args = {"attribute": (PROMPTS, TARGET), "attribute_direction": (PROMPTS, torch.ones(64)),
            "attribute_generation": (PROMPTS, 2), "attribute_scores": (PROMPTS, HEAD),
            "attribute_dataset": ([{"prompt": p, "target": TARGET} for p in PROMPTS],)}[verb]
    more = {"layer": STOP} if verb == "attribute_direction" else {}
    return getattr(dla_recipes, verb)(model, *args, **more, **kw)


@pytest.mark.parametrize(("verb", "option"), REFUSED_CELLS)
def test_refused_cell_names_its_reason(verb, option):
    model = tiny_model("llama")
    reason = refusal(verb, option)
    with pytest.raises(InputError) as error:
        call_verb(verb, model, **options(verb, option, model))
    assert reason in str(error.value), (verb, option, str(error.value))
    assert f"{verb} does not take {field(option)}=" in str(error.value)


def test_the_matrix_is_the_product():
    """The parametrization is the product, every cell in exactly one of the three lists; REFUSED names only verbs
    and options that exist."""
    assert sorted(REFUSED_CELLS + LOCAL_CELLS + REMOTE_CELLS) == sorted(CELLS)
    fields = {f for f in ask("attribute").__dataclass_fields__}
    assert all(key[0] in VERBS and key[1] in fields for key in REFUSED)
    pairs = {key for key in REFUSED if len(key) == 2 and key[1] in map(field, OPTIONS)}  # (verb, option): any value
    assert pairs <= {(v, field(o)) for v, o in REFUSED_CELLS}
    assert {(v, field(o)) for v, o in REFUSED_CELLS} <= pairs | {key[:2] for key in REFUSED if len(key) == 3}


def test_ask_names_every_bad_option_at_once():
    """Several bad options (and a refused pair) -> one InputError listing every one of them."""
    model = tiny_model("llama")
    with pytest.raises(InputError) as error:
        dla_recipes.attribute(model, PROMPTS, TARGET, by="heads", check="everything", reduce="mean", batch_size=0,
                              blocking=False, fast="yes", intervene="zero L1.H1", dictionaries=[])
    text = str(error.value)
    assert text.startswith("8 problems with the options:"), text
    for part in ("by=", "check='everything'", "reduce='mean'", "batch_size", "blocking=False", "fast='yes'",
                 "intervene must be a function", "dictionaries=list"):
        assert part in text, (part, text)
    with pytest.raises(InputError) as error:
        dla_recipes.attribute_scores(model, PROMPTS, HEAD, reduce="sum", check="adds", sources={"layers": [1]},
                                     tolerance=-1.0)
    text = str(error.value)
    for option in ("reduce", "check", "sources"):
        assert REFUSED[("attribute_scores", option)] in text, (option, text)
    assert "tolerance=-1.0" in text and text.startswith("5 problems"), text  # and sources= without by='source' 


# -- the named cases -----------------------------------------------------------------------------------------


LONG = [PROMPTS[0], PROMPTS[2]]  # 6 and 4 tokens


@pytest.mark.parametrize("position", [None, 2], ids=["every-position", "absolute-position-2"])
def test_steered_generation_is_transformers_generate_under_the_hook(position):
    """``attribute_generation(intervene=)``: a vector added to block 1's MLP output (everywhere, or at absolute
    position 2 only) gives transformers' ``generate(use_cache=False)`` answers under a hook making the same edit,
    each prompt alone; each step's parts sum to the hooked plain forward of prompt + answer alone."""
    model = tiny_model("llama")
    vector = steering_vector(model)

    def at_two(m, vector=vector):
        m.layers[1].mlp.output[:, 2] += vector

    texts = PROMPTS if position is None else LONG  # position 2 is in every prompt
    attr = dla_recipes.attribute_generation(model, texts, STEPS, progress=False,
                                            intervene=steer_fn(vector) if position is None else at_two)
    prompts, answers = generated_reference(model, True, position, texts=texts)
    assert [list(a) for a in attr.generation.answers] == answers
    assert answers != generated_reference(model, False, texts=texts)[1], "the edit changed no answer: it could not fail"
    wants = []
    with hooked(mlp_module(model), add_hook(vector, position)):
        for p, a in zip(prompts, answers):
            z = own_logits(model, p + a)
            wants.append([float(z[len(p) - 1 + k, t]) for k, t in enumerate(a)])
    assert_model_values(attr, wants, None, ("steered", position))


def test_features_on_generated_tokens():
    """``attribute_generation(dictionaries={"L1.mlp": dict})``: at every step ``k`` the latents, bias and error are
    ``test_features.reference`` on a plainly hooked forward of prompt + answer[:k] alone (its last position is the
    step's predicting position), along the generated token's unembedding through the final norm."""
    model = tiny_model("llama")
    attr = dla_recipes.attribute_generation(model, PROMPTS, STEPS, dictionaries={"L1.mlp": dictionary_for(model).dictionary()})
    prompts, answers = generated_reference(model, False)
    assert [list(a) for a in attr.generation.answers] == answers
    active = 0
    for b, (p, a) in enumerate(zip(prompts, answers)):
        for k, t in enumerate(a):
            active += check_latents(model, attr.values[b, k], attr.labels, p + a[:k], t, what=("step", b, k))
    assert 0 < active < D_SAE * sum(map(len, answers)), active


def test_a_hidden_write_in_a_bfloat16_generation_is_caught():
    """A torch hook adding 1% of the stream's norm to block 0's output for the whole call (the generation and its
    teacher-forced pass) in bfloat16: ``check="adds"`` raises ``ExactnessError`` naming block 0; without the hook
    the same call passes (no false alarm), and the default check lets the write through (below its bound)."""
    from dla_recipes.testing import tiny

    model = dla_recipes.load(tiny.build("llama").to(torch.bfloat16), tokenizer=tiny.tokenizer(), device_map="cpu")
    healthy = dla_recipes.attribute_generation(model, PROMPTS, STEPS, by="head", check="adds")
    assert healthy.dtype == "bfloat16" and int(healthy.mask.sum()) > 0
    with hooked(model.layers[0]._module, hidden_write(model)), pytest.raises(ExactnessError, match="block 0's") as error:
        dla_recipes.attribute_generation(model, PROMPTS, STEPS, by="head", check="adds")
    assert "stream between block 0's output and block 1's input" in str(error.value), str(error.value)


# -- remote and blocking=False on the loopback server --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_tiny(tmp_path_factory.mktemp("served"), ["llama"]) as running:
        yield running


@pytest.mark.server
@pytest.mark.parametrize(("verb", "option"), [pytest.param(v, o, marks=marks(v, o)) for v, o in REMOTE_CELLS])
def test_remote_cell(server, verb, option):
    """``remote=True`` / ``blocking=False`` (a ``RemoteJob`` waited on): the same checks against the model's own
    output as locally (``ref``: tiny llama, the served weights), and the result equals the local call's."""
    remote_model = server.remote_model("llama")
    extra = options(verb, option, remote_model)
    with server.client():
        if verb == "attribute_scores":
            remote = scores_cell(remote_model, eager_model("llama"), "none", extra)
        else:
            remote = run_cell(verb, "none", remote_model, tiny_model("llama"), extra)
    with single_threaded():
        local_model = server.local_model("llama")
        local = (scores_cell(local_model, eager_model("llama"), "none") if verb == "attribute_scores" else
                 run_cell(verb, "none", local_model, tiny_model("llama")))
    assert getattr(remote, "labels", None) == getattr(local, "labels", None)
    assert torch.equal(remote.values.nan_to_num(), local.values.nan_to_num()), (verb, option)


@pytest.mark.server
def test_remote_equals_local_with_dictionaries_and_intervene(server):
    """The issue's pairs: ``attribute_generation(dictionaries=)`` and ``attribute_direction(intervene=)`` on the
    loopback server equal the local calls (single-threaded, as the server computes) and the model's own output."""
    remote_model, local_model = server.remote_model("llama"), server.local_model("llama")
    ref = tiny_model("llama")
    for verb, option in (("attribute_generation", "dictionaries"), ("attribute_direction", "intervene")):
        extra = {"remote": True}
        with server.client():
            remote = run_cell(verb, option, remote_model, ref, extra)
        with single_threaded():
            local = run_cell(verb, option, local_model, ref, {})
        assert remote.labels == local.labels, verb
        if verb == "attribute_generation":
            assert remote.generation.answers == local.generation.answers
        gap = float((remote.values - local.values).nan_to_num().abs().max())
        assert torch.equal(remote.values.nan_to_num(), local.values.nan_to_num()), (verb, gap)
        assert math.isfinite(gap)
