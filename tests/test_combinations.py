"""``intervene=`` at every granularity, on padding-safe and padding-unsafe families, against the edited forward itself.

The suite's other edit tests run at ``by="head"`` (or ``"block"``) on padding-safe families. Here every granularity
(block, head, neuron, expert on mixtures of experts, source on eager attention) meets four edits:

- ``zero_head``: one head's slice of the attention output projection's input set to 0 at every token;
- ``patch_head``: that slice at the last token replaced by a second prompt's (its value read beforehand);
- ``patch_attn``: the whole attention output (after its projection) at the last token replaced by a second prompt's;
- ``steer_mlp``: a steering vector added to what one block's MLP outputs, at the last token;
- ``zero_values``: one key-value group's slice of the value projection's output set to 0 (upstream of the heads:
  every split sees it; not on latent attention, which has no value projection).

The reference for each is the model's own edited forward: a plain transformers forward of each prompt alone, with
torch forward (pre-)hooks on the same submodules of ``model._module`` making the same edit, and its target minus
contrast logit at the last token (before the soft-cap where the family has one). The parts must sum to it within
float32's 1e-4 * max(1, |logit|). The padding-unsafe families run their prompts grouped by length, so the edit runs
once per group, on that group's rows.

An edit made after a split term's projection (``patch_attn`` at head / source, ``steer_mlp`` at neuron / expert) is
what no head or neuron wrote: its share is reported in the term's ``L{i}.{term}.edit`` column (nonzero), and the block
term at ``by="block"`` equals the term's parts + rest + edit; an edit every part sees leaves each ``.edit`` column at
0 (float32 rounding). One combination is a known defect, a strict xfail: ``by="source"`` with a head edited at the
output projection's input.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import CONTRAST, PROMPTS, TARGET, tiny_model, tolerance

import dla_recipes
from dla_recipes import models
from dla_recipes.families import family_of
from dla_recipes.testing import tiny

CORRUPT = "w30 w31 w32 w33 w34 w35"  # the second prompt the patches read from
HEAD = 1
# family -> (the block whose attention is edited, the block whose MLP is steered): a block with heads, and on a
# mixture of experts a block with routed experts
LAYERS = {"llama": (1, 1), "gemma3": (1, 1), "mixtral": (1, 1), "qwen2_moe": (1, 1),
          "recurrent_gemma": (1, 1), "jamba": (1, 2), "deepseek_v32": (1, 1), "olmo_hybrid": (1, 1), "bamba": (1, 1)}
# padding-unsafe (recurrent state, a router or sparse indexer reading the pads): grouped by length, one trace a group
UNSAFE = ["recurrent_gemma", "jamba", "deepseek_v32", "olmo_hybrid", "bamba"]
BY_FAMILIES = {
    "block": ["llama", "gemma3", "recurrent_gemma", "jamba", "deepseek_v32"],
    "head": ["llama", "gemma3", "recurrent_gemma", "jamba", "deepseek_v32"],  # deepseek_v32: v_head_dim != head_dim
    "neuron": ["llama", "gemma3", "recurrent_gemma", "jamba", "deepseek_v32"],
    "expert": ["mixtral", "qwen2_moe", "jamba", "deepseek_v32"],
    "source": ["llama", "gemma3", "mixtral", "olmo_hybrid", "bamba"],  # eager attention; families that split by source
}
EDITS = ["zero_head", "patch_head", "patch_attn", "steer_mlp", "zero_values"]
LATENT = {"deepseek_v32"}  # no value projection to zero
# an edit after a split term's projection: at these granularities it lands in that term's .edit column
AFTER_PROJECTION = {"patch_attn": ("attn", {"head", "source"}), "steer_mlp": ("mlp", {"neuron", "expert"})}
# by="source" splits a head into its sources from the attention pattern and the values, upstream of the output
# projection's input: an edit of that input (the documented way to zero or patch a head) is not seen by the sources,
# so the split is refused, naming the block and the edit (the rebuilt heads are checked against o_proj's input).
# Before that check the sum held only through L{i}.attn.edit while a zeroed head's sources kept their values.
SOURCES_REFUSE_HEAD_EDITS = ("zero_head", "patch_head")
SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")  # the config fields of a logit soft-cap


# -- the reference: a plain transformers forward with torch hooks --------------------------------------------------


def token_id(model, token: str) -> int:
    return model.tokenizer(token, add_special_tokens=False)["input_ids"][0]


def first(output):
    """The hidden states of a module's output (an attention module returns ``(hidden, weights, ...)``)."""
    return output[0] if isinstance(output, tuple) else output


def replace_first(output, hidden):
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def hooked_logits(model, prompt: str, hooks=()) -> torch.Tensor:
    """``[vocab]`` float64: the last token's logits of ``prompt`` alone in a plain transformers forward (no nnsight),
    with ``hooks``: ``(torch module, "pre" | "post", fn)``, ``fn`` returning the module's new input / output."""
    handles = []
    try:
        for module, kind, fn in hooks:
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(
                    lambda _, args, fn=fn: (fn(args[0].clone()), *args[1:])))
            else:
                handles.append(module.register_forward_hook(lambda _, args, out, fn=fn: fn(out)))
        ids = model.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            logits = model._module(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return logits.double()


def logit_difference(model, logits: torch.Tensor, target=TARGET, contrast=CONTRAST) -> tuple[float, float]:
    """``(before the soft-cap, as output)``: target minus contrast; the parts sum to the logits before the cap."""
    pair = logits[[token_id(model, target), token_id(model, contrast)]]
    output = float(pair[0] - pair[1])
    cap = next((getattr(model.config, name) for name in SOFTCAPS if getattr(model.config, name, None)), None)
    if cap is not None:
        pair = cap * torch.atanh(pair / cap)
    return float(pair[0] - pair[1]), output


def captured(model, prompt: str, module, kind: str) -> torch.Tensor:
    """What ``module`` reads (``"pre"``) or writes (``"post"``) at the last token of ``prompt`` alone."""
    seen = {}

    def keep(x):
        seen["x"] = first(x)[0, -1].clone()
        return x

    hooked_logits(model, prompt, [(module, kind, keep)])
    return seen["x"]


# -- the edits, each as nnsight code for intervene= and as torch hooks on a plain forward ------------------------


@dataclass(frozen=True)
class Edit:
    name: str
    intervene: object  # fn(model): nnsight code
    hooks: tuple  # ((torch module, "pre" | "post", fn), ...): the same edit on a plain forward
    layer: int  # the block it edits


def head_columns(model, layer: int, head: int) -> slice:
    """Head ``head``'s columns of the attention output projection's input: the projection's input width over the
    head count (not ``hidden_size // num_heads``: Gemma-3 and latent attention have other head widths)."""
    width = model.layers[layer].self_attn.o_proj._module.in_features // model.config.num_attention_heads
    return slice(head * width, (head + 1) * width)


def group_heads(model) -> range:
    """The query heads that read HEAD's key-value group."""
    per_group = model.config.num_attention_heads // model.config.num_key_value_heads
    group = HEAD // per_group
    return range(group * per_group, (group + 1) * per_group)


def value_columns(model, layer: int) -> slice:
    """HEAD's key-value group's columns of the value projection's output."""
    width = model.layers[layer].self_attn.v_proj._module.out_features // model.config.num_key_value_heads
    group = HEAD // (model.config.num_attention_heads // model.config.num_key_value_heads)
    return slice(group * width, (group + 1) * width)


def make_edit(model, family: str, name: str) -> Edit:
    attn_layer, mlp_layer = LAYERS[family]
    attention = model.layers[attn_layer].self_attn._module
    o_proj = model.layers[attn_layer].self_attn.o_proj._module
    sl = head_columns(model, attn_layer, HEAD)
    if name == "zero_head":
        def zero(m):
            m.layers[attn_layer].self_attn.o_proj.input[:, :, sl] = 0

        def zero_x(x):
            x[..., sl] = 0
            return x
        return Edit(name, zero, ((o_proj, "pre", zero_x),), attn_layer)
    if name == "patch_head":
        value = captured(model, CORRUPT, o_proj, "pre")[sl]  # [head_dim]: one value for every row

        def patch(m):
            m.layers[attn_layer].self_attn.o_proj.input[:, -1, sl] = value

        def patch_x(x):
            x[0, -1, sl] = value
            return x
        return Edit(name, patch, ((o_proj, "pre", patch_x),), attn_layer)
    if name == "patch_attn":
        value = captured(model, CORRUPT, attention, "post")  # [d_model]
        as_tuple = isinstance(attention_output(model, attn_layer), tuple)

        def patch_out(m):
            out = m.layers[attn_layer].self_attn.output
            (out[0] if as_tuple else out)[:, -1] = value

        def patch_y(out):
            hidden = first(out).clone()
            hidden[0, -1] = value
            return replace_first(out, hidden)
        return Edit(name, patch_out, ((attention, "post", patch_y),), attn_layer)
    if name == "zero_values":
        vs = value_columns(model, attn_layer)

        def zero_v(m):
            m.layers[attn_layer].self_attn.v_proj.output[:, :, vs] = 0

        def zero_vy(out):
            out = out.clone()
            out[..., vs] = 0
            return out
        return Edit(name, zero_v, ((model.layers[attn_layer].self_attn.v_proj._module, "post", zero_vy),), attn_layer)
    vector = torch.linspace(-2.0, 2.0, model.config.hidden_size)
    mlp = model.layers[mlp_layer].mlp._module

    def steer(m):
        m.layers[mlp_layer].mlp.output[:, -1] += vector

    def steer_y(out):
        hidden = first(out).clone()
        hidden[0, -1] += vector
        return replace_first(out, hidden)
    return Edit(name, steer, ((mlp, "post", steer_y),), mlp_layer)


def attention_output(model, layer: int):
    seen = {}
    hooks = [(model.layers[layer].self_attn._module, "post", lambda out: seen.setdefault("out", out))]
    hooked_logits(model, PROMPTS[0], hooks)
    return seen["out"]


# -- the cases ----------------------------------------------------------------------------------------------------

_EAGER: dict = {}
_BLOCK: dict = {}


def model_for(family: str, by: str):
    if by != "source":
        return tiny_model(family)
    if family not in _EAGER:
        _EAGER[family] = tiny.standardized(family, attn_implementation="eager")
    return _EAGER[family]


def case(by: str, family: str, edit: str):
    return pytest.param(by, family, edit, id=f"{by}-{family}-{edit}")


CASES = [case(by, family, edit) for by, families in BY_FAMILIES.items() for family in families for edit in EDITS
         if not (edit == "zero_values" and family in LATENT)]


def edit_columns(attr) -> dict[str, torch.Tensor]:
    """The ``L{i}.{term}.edit`` columns: label -> ``[batch]``."""
    return {label: attr.values[:, j] for j, label in enumerate(attr.labels) if label.endswith(".edit")}


@pytest.mark.parametrize("by,family,edit", CASES)
def test_intervene_at_every_granularity(by, family, edit):
    model = model_for(family, by)
    assert family_of(model).padding_safe == (family not in UNSAFE), family
    change = make_edit(model, family, edit)
    if by == "source" and edit in SOURCES_REFUSE_HEAD_EDITS:
        with pytest.raises(dla_recipes.DLAError, match=r"by='source' cannot split block \d+'s heads.*o_proj's input") as info:
            dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, intervene=change.intervene,
                                  progress=False)
        assert type(info.value) is dla_recipes.DLAError  # a refusal, not an ExactnessError
        return
    attr = dla_recipes.attribute(model, PROMPTS, TARGET, contrast=CONTRAST, by=by, intervene=change.intervene,
                                 progress=False)
    edited = [logit_difference(model, hooked_logits(model, p, change.hooks)) for p in PROMPTS]
    reference = torch.tensor([pre for pre, _ in edited])
    bound = tolerance(reference)
    assert bool(((attr.total - reference).abs() <= bound).all()), (attr.total, reference)
    assert bool(((attr.logit - reference).abs() <= bound).all()), (attr.logit, reference)
    output = torch.tensor([out for _, out in edited])
    assert bool(((attr.output_logit - output).abs() <= tolerance(output)).all()), (attr.output_logit, output)
    plain = torch.tensor([logit_difference(model, hooked_logits(model, p))[0] for p in PROMPTS])
    assert float((plain - reference).abs().max()) > 1e-3, "the edit changed nothing: the test could not fail"

    zeroed = {"zero_head": [HEAD], "zero_values": group_heads(model)}.get(edit, ())
    if by in ("head", "source") and zeroed:  # a zeroed head writes nothing, from any source: exactly 0
        own = [j for j, c in enumerate(attr.components)
               if c.layer == change.layer and c.part == "head" and c.index in zeroed]
        assert len(own) >= len(zeroed) and bool((attr.values[:, own] == 0).all()), attr.values[:, own]
    if by == "block":
        return
    key = (family, edit)
    if key not in _BLOCK:
        _BLOCK[key] = dla_recipes.attribute(model_for(family, "block"), PROMPTS, TARGET, contrast=CONTRAST,
                                            intervene=make_edit(model_for(family, "block"), family, edit).intervene,
                                            progress=False)
    block = _BLOCK[key]
    # every block term equals its parts + rest (+ edit): by name, never the label lists of two calls
    summed = attr.blocks()
    for j, label in enumerate(summed.labels):
        k = block.labels.index(label)
        gap = (summed.values[:, j] - block.values[:, k]).abs()
        assert bool((gap <= bound).all()), (label, summed.values[:, j], block.values[:, k])
    term, where = AFTER_PROJECTION.get(edit, (None, ()))
    columns = edit_columns(attr)
    if by in where:  # the edit's share lands in the edited term's .edit column: nonzero
        share = columns[f"L{change.layer}.{term}.edit"]
        assert float(share.abs().max()) > 1e-3, share
        # and the edited block term at by="block" is that term's parts + rest + edit
        label = f"L{change.layer}.{term}"
        mine = [j for j, c in enumerate(attr.components) if (c.layer, c.term) == (change.layer, term)]
        total = attr.values[:, mine].sum(-1)
        if attr.labels.index(f"{label}.edit") not in mine:
            total = total + share
        assert bool(((total - block.values[:, block.labels.index(label)]).abs() <= bound).all()), (total, block)
    else:  # an edit every part explains (before the projection, or of a term not split here) leaves edit ~0
        for label, share in columns.items():
            assert bool((share.abs() <= bound).all()), (label, share)


# -- a real model ---------------------------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow  # loads SmolLM2 for this test alone: ~4 s of CPU
def test_smollm2_patch_and_zero_at_neuron_granularity():
    """SmolLM2-135M: one head patched from a second prompt and another zeroed, attributed by neuron on a padded
    batch of two prompts of different lengths; the MLP steered at by="head" (the MLPs stay whole there)."""
    model = dla_recipes.load(models.default_model_path(), dispatch=True)  # its weights read before the first trace
    prompts = ["The Eiffel Tower is in the city of", "The capital of Italy is the city of Rome, and of France"]
    target, contrast, layer = " Paris", " Rome", 29
    o_proj = model.layers[layer].self_attn.o_proj._module
    patched, zeroed = head_columns(model, layer, 1), head_columns(model, layer, 2)
    value = captured(model, "The Colosseum is in the city of", o_proj, "pre")[patched]

    def both(m):
        x = m.layers[layer].self_attn.o_proj.input
        x[:, :, zeroed] = 0
        x[:, -1, patched] = value

    def both_x(x):
        x[..., zeroed] = 0
        x[0, -1, patched] = value
        return x

    attr = dla_recipes.attribute(model, prompts, target, contrast=contrast, by="neuron", intervene=both)
    reference = torch.tensor([logit_difference(model, hooked_logits(model, p, [(o_proj, "pre", both_x)]),
                                               target, contrast)[0] for p in prompts])
    plain = torch.tensor([logit_difference(model, hooked_logits(model, p), target, contrast)[0] for p in prompts])
    assert float((plain - reference).abs().max()) > 1e-2
    assert bool(((attr.total - reference).abs() <= tolerance(reference)).all()), (attr.total, reference)

    vector = 0.5 * model.lm_head.weight[token_id(model, target)].detach().float()  # towards " Paris"
    mlp = model.layers[20].mlp._module

    def steer(m):
        m.layers[20].mlp.output[:, -1] += vector

    def steer_y(out):
        out = out.clone()
        out[0, -1] += vector
        return out

    steered = dla_recipes.attribute(model, prompts, target, contrast=contrast, by="head", intervene=steer)
    reference = torch.tensor([logit_difference(model, hooked_logits(model, p, [(mlp, "post", steer_y)]),
                                               target, contrast)[0] for p in prompts])
    assert float((plain - reference).abs().max()) > 1e-2
    assert bool(((steered.total - reference).abs() <= tolerance(reference)).all()), (steered.total, reference)
