"""Building the plan: the family table resolved against one model's config and module tree (client side, cached).

``build_plan(model)`` walks the model's blocks once, picks each block's terms from its family entry (the table
composes: optional terms are kept where their paths exist), checks every path the table names, reads the shapes
that split a term into heads, neurons or experts, resolves the config scalars, and fixes each term's ``kind``. A
path that does not resolve, a projection that is not a linear map, a width that does not split into heads: each
raises a ``FamilyTableError`` here, before any forward pass runs.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import FamilyTableError
from ..families import Experts, Family, Heads, Neurons, Routed, Term, family_of, text_config
from .plan import Kind, Plan, PlannedTerm


def module_at(root, path: str):
    """The submodule (or envoy) at a dotted ``path`` below ``root``."""
    obj = root
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def has_path(layer, path: str) -> bool:
    """Whether ``path`` resolves below a block envoy (aliases included) to something that is not None."""
    obj = layer
    for name in path.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return obj is not None


def layer_terms(family: Family, layer) -> tuple[Term, ...]:
    """The terms block ``layer`` (an envoy) writes: those of the first layer kind of ``family`` whose ``when`` path
    exists on it, less the optional terms whose ``when`` path is missing or whose ``unless`` path exists."""
    for kind in family.kinds:
        when = (kind.when,) if isinstance(kind.when, str) else kind.when or ()
        if all(has_path(layer, path) for path in when):
            return tuple(
                term for term in kind.terms
                if (term.when is None or has_path(layer, term.when))
                and (term.unless is None or not has_path(layer, term.unless))
            )
    raise FamilyTableError(
        f"family {family.name!r}: block {type(layer._module).__name__} matches none of its layer kinds "
        f"({', '.join(repr(k.when) for k in family.kinds)})"
    )


def config_value(config, name):
    """``config.<name>`` as a float; ``name`` may index a list (``"mlp_multipliers[1]"``) or be a function of the
    config (returning a float)."""
    if callable(name):
        return float(name(config))
    attribute, _, index = name.partition("[")
    value = getattr(config, attribute)
    return float(value[int(index.rstrip("]"))] if index else value)


def head_scalar(config, name: str | None) -> float:
    """A final-head scale the family table names (``logits_times``, ``logits_over``, ``head_input_over``), as a float:
    1.0 when the entry names none or the config holds ``None`` there. A ``None`` scale is one the model does not
    apply (CohereCompass's ``logit_scale`` defaults to ``None``, which its head reads as 1.0); a model that fails on
    it fails in its own forward, and one that read it as anything else would be caught by the self-check."""
    value = getattr(config, name) if name is not None else None
    return 1.0 if value is None else float(value)


def _linear_shape(module: torch.nn.Module) -> tuple[int, int, bool]:
    """``(in_features, out_features, transposed)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and weight is not None:
        return int(weight.shape[0]), int(weight.shape[1]), True
    raise FamilyTableError(f"{type(module).__name__} is not a linear projection (nn.Linear or Conv1D)")


def scalar(value, config, layer: int) -> float:
    """A term's scalar resolved for block ``layer``: 1.0 (None), ``config[value]`` (a name, or ``"name[i]"`` for a
    list item), or ``value(config, layer)``."""
    if value is None:
        return 1.0
    return float(value(config, layer)) if callable(value) else config_value(config, value)


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (family, plan): plans cost a module walk


def build_plan(model, family: Family | None = None) -> Plan:
    """Resolve the family table against ``model`` (a StandardizedTransformer, possibly without weights).

    The plan is cached per model (and family entry); a model whose modules are swapped after loading needs
    ``build_plan.cache_clear()``.
    """
    family = family or family_of(model)
    cached = _PLANS.get(model)
    if cached is not None and cached[0] is family:
        return cached[1]
    plan = plan_for(model, family)
    _PLANS[model] = (family, plan)
    return plan


build_plan.cache_clear = _PLANS.clear

KIND_OF_SPLIT: dict[type, Kind] = {Heads: "linear", Neurons: "linear", Experts: "experts", Routed: "routed"}


def kind_of(term: Term) -> Kind:
    """How the in-trace recipe reads ``term``'s parts (``PlannedTerm.kind``): ``"block"`` when never split, else its
    split record's kind (``KIND_OF_SPLIT``), ``"conv"`` for a linear split under a position convolution."""
    if term.split is None:
        return "block"
    kind = KIND_OF_SPLIT[type(term.split)]
    return "conv" if kind == "linear" and term.split.position_conv is not None else kind


def _experts_shape(family: Family, i: int, layer, term: Term, d_model: int) -> tuple[int, int]:
    """``(experts, neurons per expert)`` of a fused experts module, from its layout's weights."""
    layout, projection = term.split.layout, term.split.projection
    module = module_at(layer, projection)._module
    activation = layout.gating if layout.gating is not None and layout.gate_up is not None else layout.activation
    for path in (layout.gate_up, layout.gate, layout.up, layout.down, layout.gate_up_bias, layout.down_bias, activation):
        if path is not None and not has_path(module, path):
            raise FamilyTableError(
                f"family {family.name!r}: block {i}: the experts module {projection} ({type(module).__name__}) "
                f"has no {path!r} (term {term.name!r}); the family table's ExpertsLayout does not describe it"
            )
    down = module_at(module, layout.down)
    experts = int(getattr(module, "num_experts", 0) or down.shape[0])
    if down.numel() % (experts * d_model):
        raise FamilyTableError(
            f"family {family.name!r}: block {i}: {projection}.{layout.down} {tuple(down.shape)} does not split "
            f"into {experts} experts of width d_model={d_model}"
        )
    return experts, down.numel() // (experts * d_model)


def norm_biased(norm) -> bool:
    """Whether a norm (an envoy) may add a constant (its output at a zero input: ``probe_norm``'s bias): any
    parameter or buffer besides its gain ``weight``. An RMSNorm or a LayerNorm without a bias adds none."""
    module = norm._module
    named = list(module.named_parameters()) + list(module.named_buffers())
    return any(name.rsplit(".", 1)[-1] != "weight" for name, _ in named)


def rest_biased(layer, term: Term, outer_bias: bool) -> bool:
    """Whether something besides ``term``'s parts writes into its rest at every split mode (``trace.terms``): a
    bias of its write or of the stream, of its projection or the map after it (heads, neurons), of its shared
    expert or its routed projection, or a norm's on its way (its post-norm, its outer norm where ``outer_bias``:
    the block's first term naming it, the stream norms before and after it)."""
    write, stream, split = term.write, term.stream, term.split
    if write.bias is not None or stream.bias is not None:
        return True
    if isinstance(split, Routed) and split.projection_bias is not None:
        return True
    norms = (write.post_norm, stream.norm, stream.norm_after, write.outer_norm if outer_bias else None)
    if any(path is not None and norm_biased(module_at(layer, path)) for path in norms):
        return True
    linear = (split.projection, split.then) if isinstance(split, (Heads, Neurons)) else ()
    linear += (split.shared,) if isinstance(split, Experts) else ()
    return any(path is not None and getattr(module_at(layer, path)._module, "bias", None) is not None
               for path in linear)


def bare_modes(layer, term: Term, outer_bias: bool, last: bool) -> frozenset:
    """The split modes at which ``term`` has no rest column (``PlannedTerm.bare``): nothing but its parts writes
    there, and its parts' labels name its block, so an ``Attribution`` read back from labels alone still sums each
    part into it: heads are an ``attn`` term's (``L3.H5``, also by source); neurons (``L3.N5``) an ``mlp``'s and
    experts (``L3.E2``) an ``experts``' when the term is the last of its block (``components.parse_labels``). A
    fused experts' down bias writes into the rest of its neurons (by expert it is in each expert's part)."""
    if term.split is None or rest_biased(layer, term, outer_bias):
        return frozenset()
    if term.splits_heads:
        return frozenset({"heads", "sources"}) if term.name == "attn" else frozenset()
    modes = {"mlp": {"neurons"}, "experts": {"experts", "expert_neurons"}}.get(term.name, set()) if last else set()
    if isinstance(term.split, Experts) and term.split.layout.down_bias is not None:
        modes.discard("expert_neurons")
    return frozenset(modes)


def plan_for(model, family: Family) -> Plan:
    """``model``'s plan for ``family``, built now (not cached: ``trace_attribution`` builds it server side)."""
    config = text_config(model)
    d_model = int(model.lm_head.weight.shape[-1])
    num_heads = int(getattr(model, "num_heads", None) or getattr(config, "num_attention_heads", None) or 0)
    layers = []
    for i, layer in enumerate(model.layers):
        layer_module = layer._module
        planned, outer = [], set()
        terms = layer_terms(family, layer)
        for k, term in enumerate(terms):
            for path in term.paths():  # every path field of the term and its records
                if path not in ("output", "input") and not has_path(layer, path):
                    raise FamilyTableError(
                        f"family {family.name!r}: block {i} ({type(layer_module).__name__}) has no {path!r} "
                        f"(term {term.name!r}); the family table entry does not describe this model"
                    )
            split = term.split
            multiplier = scalar(term.write.multiplier, config, i)
            parts = width = experts = expert_width = shared_width = 0
            routed_scale = shared_scale = 1.0
            transposed = False
            if isinstance(split, Routed):  # grouped experts: weight [E, d_model, in]
                module = module_at(layer, split.projection)._module
                experts, in_features = int(module.weight.shape[0]), int(module.weight.shape[-1])
                top_k = int(module_at(layer, split.router)._module.top_k)
                if split.parts == "heads":
                    width = int(getattr(config, "kv_channels", None) or config.head_dim)
                    parts = top_k * in_features // width
                else:
                    expert_width = in_features
            elif isinstance(split, Experts):
                experts, expert_width = _experts_shape(family, i, layer, term, d_model)
                if split.shared is not None:
                    shared_width = _linear_shape(module_at(layer, split.shared)._module)[0]
                layout = split.layout
                routed_scale = 1.0 if layout.routed_scale is None else config_value(config, layout.routed_scale)
                shared_scale = 1.0 if layout.shared_scale is None else config_value(config, layout.shared_scale)
            elif isinstance(split, (Heads, Neurons)):
                module = module_at(layer, split.projection)._module
                in_features, _, transposed = _linear_shape(module)
                in_features *= int(getattr(module, "n_groups", 1))  # a grouped projection reads every group
                if isinstance(split, Heads):
                    if in_features % num_heads:
                        raise FamilyTableError(
                            f"family {family.name!r}: block {i}: {split.projection} reads {in_features} features, "
                            f"not a multiple of {num_heads} heads"
                        )
                    parts, width = num_heads, in_features // num_heads
                else:
                    parts, width = in_features, 1
            parallel = bool(getattr(config, term.parallel)) if isinstance(term.parallel, str) else term.parallel
            planned.append(
                PlannedTerm(term, multiplier=multiplier, parts=parts, part_width=width, transposed=transposed,
                            experts=experts, expert_width=expert_width, shared_width=shared_width, parallel=parallel,
                            routed_scale=routed_scale, shared_scale=shared_scale,
                            stream_multiplier=scalar(term.stream.multiplier, config, i),
                            projection_multiplier=scalar(getattr(split, "projection_multiplier", None), config, i),
                            kind=kind_of(term),
                            bare=bare_modes(layer, term, term.write.outer_norm not in outer, k == len(terms) - 1))
            )
            outer.add(term.write.outer_norm)
        layers.append(tuple(planned))
    logit_scale = head_scalar(config, family.logits_times) / head_scalar(config, family.logits_over)
    softcap = float(getattr(config, family.softcap)) if family.softcap and getattr(config, family.softcap, None) else None
    head_input_scale = 1.0 / head_scalar(config, family.head_input_over)
    return Plan(family, tuple(layers), logit_scale, softcap, num_heads, head_input_scale)
