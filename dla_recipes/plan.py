"""The family table resolved against one concrete model: per block, the terms it writes and their shapes.

A ``Plan`` is built client side from the model's config and module tree (a remote model built without weights has
both), travels into the trace as a small frozen dataclass, and tells the in-trace recipe what to read, in forward
order, and how to label it. Building it checks the table against the model: a path that does not resolve, a
projection that is not a linear map, a width that does not split into heads, each raise a clear error before any
forward pass runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .errors import FamilyTableError, InputError
from .families import Family, Term, family_of

Granularity = str  # "block" | "head" | "neuron" | "expert" | "source"
Stop = tuple  # (layer, number of that block's terms already added): a point in the residual stream
GRANULARITIES = ("block", "head", "neuron", "expert", "source")


@dataclass(frozen=True)
class Sources:
    """How ``by="source"`` splits heads: which heads are split over source positions, and into how many.

    Attributes:
        count: sources per split head, ``S0 .. S{count-1}``: indices into each prompt's own tokens (0 = its first
            token, whatever the padding); ``count`` is the largest attributed own position plus one, so a prompt
            whose attributed position is earlier has zeros for the sources it does not have.
        heads: the ``(layer, head)`` pairs split by source; None: every head. The other heads stay whole
            (``L3.H5``), as with ``by="head"``.
    """

    count: int
    heads: frozenset | None = None

    def split(self, layer: int, heads: int) -> tuple[bool, ...]:
        """Which of block ``layer``'s ``heads`` are split by source."""
        if self.heads is None:
            return (True,) * heads
        return tuple((layer, h) in self.heads for h in range(heads))


@dataclass(frozen=True)
class PlannedTerm:
    """A ``Term`` with its constants and shapes resolved for one block.

    Attributes:
        term: the table's ``Term``.
        multiplier: ``config[term.multiplier]`` as a float (1.0 when none).
        parts: heads / neurons split: how many pieces ``projection.input`` splits into.
        part_width: the width of one piece (``head_dim`` for heads, 1 for neurons).
        transposed: the projection stores its weight ``[in, out]`` (GPT-2's ``Conv1D``) rather than ``[out, in]``.
        experts, expert_width: experts split: the number of routed experts and each one's neurons.
        shared_width: experts split: the shared expert's neurons (0: none).
        parallel: the sublayer reads the same stream as the term before it (``Term.parallel`` resolved).
        routed_scale, shared_scale: experts split: the layout's scales of the routed experts and the shared expert.
        stream_multiplier, projection_multiplier: ``Term.stream_multiplier`` / ``Term.projection_multiplier``
            resolved to floats (1.0 when none).
    """

    term: Term
    multiplier: float = 1.0
    parts: int = 0
    part_width: int = 0
    transposed: bool = False
    experts: int = 0
    expert_width: int = 0
    shared_width: int = 0
    parallel: bool = False
    routed_scale: float = 1.0
    shared_scale: float = 1.0
    stream_multiplier: float = 1.0
    projection_multiplier: float = 1.0

    def mode(self, by: Granularity) -> str | None:
        """How this term splits at granularity ``by``: ``None`` (one component), ``"heads"``, ``"neurons"``,
        ``"experts"`` (one component per expert) or ``"expert_neurons"`` (one per neuron of every expert)."""
        split = self.term.split
        if split == "heads" and by == "head" and self.parts:
            return "heads"
        if split == "heads" and by == "source" and self.parts and self.term.router is None:
            return "sources" if self.term.values else "heads"
        if split == "neurons" and by == "neuron" and self.parts:
            return "neurons"
        if split == "experts" and self.experts:
            return {"expert": "experts", "neuron": "expert_neurons"}.get(by)
        return None

    def labels(self, i: int, by: Granularity, sources: Sources | None = None) -> list[str]:
        """This term's component labels in block ``i``; the last is always the block label (the term's rest).

        ``by="source"`` labels ``L3.H5.S2`` (head 5's part read from the prompt's own token 2) for the heads
        ``sources`` splits, ``L3.H5`` for the others."""
        mode, block = self.mode(by), f"L{i}.{self.term.name}"
        if mode == "sources":
            split = sources.split(i, self.parts) if sources is not None else (False,) * self.parts
            parts = [label for h in range(self.parts) for label in
                     ([f"L{i}.H{h}.S{s}" for s in range(sources.count)] if split[h] else [f"L{i}.H{h}"])]
        elif mode == "heads":
            parts = [f"L{i}.H{p}" for p in range(self.parts)]
        elif mode == "neurons":
            parts = [f"L{i}.N{p}" for p in range(self.parts)]
        elif mode == "experts":
            parts = [f"L{i}.E{e}" for e in range(self.experts)] + ([f"L{i}.shared"] if self.shared_width else [])
        elif mode == "expert_neurons":
            parts = [f"L{i}.E{e}.N{n}" for e in range(self.experts) for n in range(self.expert_width)]
            parts += [f"L{i}.shared.N{n}" for n in range(self.shared_width)]
        else:
            parts = []
        return parts + [block]


@dataclass(frozen=True)
class Plan:
    """What the in-trace recipe reads for one model. ``layers[i]`` lists block ``i``'s terms in forward order."""

    family: Family
    layers: tuple[tuple[PlannedTerm, ...], ...]
    logit_scale: float
    softcap: float | None
    num_heads: int
    head_input_scale: float = 1.0  # lm_head reads the final norm's output times this (``Family.head_input_over``)

    def labels(self, by: Granularity = "block", stop: "Stop | None" = None, sources: Sources | None = None) -> list[str]:
        """Component labels in forward order: ``embed``, ``L0.attn``, ``L0.mlp``, ... (``L3.H5`` / ``L3.N127`` /
        ``L3.E2`` / ``L3.E2.N17`` / ``L3.H5.S2`` when split; a split term keeps its block label for its rest). With
        ``stop``, only the terms written before it; ``sources``: how ``by="source"`` splits the heads."""
        check_granularity(by)
        labels = ["embed"]
        for i, terms in enumerate(self.terms_before(stop)):
            for planned in terms:
                labels.extend(planned.labels(i, by, sources))
        return labels

    def terms_before(self, stop: "Stop | None") -> list[tuple[PlannedTerm, ...]]:
        """Each block's terms written before ``stop`` (all of them when ``stop`` is None)."""
        if stop is None:
            return list(self.layers)
        layer, count = stop
        return list(self.layers[:layer]) + ([self.layers[layer][:count]] if count else [])

    def stop_before(self, layer: int, sublayer: str) -> "Stop":
        """The point where block ``layer``'s ``sublayer`` reads the stream: ``(layer, terms of it already added)``."""
        if not -len(self.layers) <= layer < len(self.layers):
            raise InputError(f"layer {layer} is outside this {len(self.layers)}-block model")
        layer %= len(self.layers)
        names = [planned.term.name for planned in self.layers[layer]]
        if sublayer not in names:
            raise InputError(f"block {layer} has no {sublayer!r} sublayer (it has {', '.join(names)})")
        k = names.index(sublayer)
        if self.layers[layer][k].term.reads is None:
            raise InputError(
                f"block {layer}'s {sublayer!r} reads the stream without a norm in front of it ({self.family.name}): "
                "there is no norm to attribute a direction through"
            )
        while k > 0 and self.layers[layer][k].parallel:  # a parallel sublayer reads the stream its neighbour reads
            k -= 1
        return (layer, k)


def check_granularity(by: str) -> None:
    """Raise ``InputError`` (suggesting the closest name) unless ``by`` is one of ``GRANULARITIES``."""
    if not isinstance(by, str) or by not in GRANULARITIES:
        from .inputs import closest

        raise InputError(
            f"by={by!r} is not a granularity: use one of {', '.join(map(repr, GRANULARITIES))}"
            f"{closest(by, GRANULARITIES)}"
        )


def module_at(root, path: str):
    """The submodule (or envoy) at a dotted ``path`` below ``root``."""
    obj = root
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _has_path(layer, path: str) -> bool:
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
        if all(_has_path(layer, path) for path in when):
            return tuple(
                term for term in kind.terms
                if (term.when is None or _has_path(layer, term.when))
                and (term.unless is None or not _has_path(layer, term.unless))
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


def _config(model):
    config = model.config
    return getattr(config, "text_config", None) or config


def _linear_shape(module: torch.nn.Module) -> tuple[int, int, bool]:
    """``(in_features, out_features, transposed)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and weight is not None:
        return int(weight.shape[0]), int(weight.shape[1]), True
    raise FamilyTableError(f"{type(module).__name__} is not a linear projection (nn.Linear or Conv1D)")


def _scalar(value, config, layer: int) -> float:
    """A term's scalar resolved for block ``layer``: 1.0 (None), ``config[value]`` (a name, or ``"name[i]"`` for a
    list item), or ``value(config, layer)``."""
    if value is None:
        return 1.0
    return float(value(config, layer)) if callable(value) else config_value(config, value)


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (family, plan): plans cost a module walk


def build_plan(model, family: Family | None = None) -> Plan:
    """Resolve the family table against ``model`` (a StandardizedTransformer, possibly without weights).

    The plan is cached per model (and family entry); a model whose modules are swapped after loading needs
    ``build_plan.cache_clear()``.
    """
    family = family or family_of(model)
    cached = _PLANS.get(model)
    if cached is not None and cached[0] is family:
        return cached[1]
    plan = _build_plan(model, family)
    _PLANS[model] = (family, plan)
    return plan


build_plan.cache_clear = _PLANS.clear


def _experts_shape(family: Family, i: int, layer, term: Term, d_model: int) -> tuple[int, int]:
    """``(experts, neurons per expert)`` of a fused experts module, from its layout's weights."""
    layout = term.layout
    module = module_at(layer, term.projection)._module
    activation = layout.gating if layout.gating is not None and layout.gate_up is not None else layout.activation
    for path in (layout.gate_up, layout.gate, layout.up, layout.down, layout.gate_up_bias, layout.down_bias, activation):
        if path is not None and not _has_path(module, path):
            raise FamilyTableError(
                f"family {family.name!r}: block {i}: the experts module {term.projection} ({type(module).__name__}) "
                f"has no {path!r} (term {term.name!r}); the family table's ExpertsLayout does not describe it"
            )
    down = module_at(module, layout.down)
    experts = int(getattr(module, "num_experts", 0) or down.shape[0])
    if down.numel() % (experts * d_model):
        raise FamilyTableError(
            f"family {family.name!r}: block {i}: {term.projection}.{layout.down} {tuple(down.shape)} does not split "
            f"into {experts} experts of width d_model={d_model}"
        )
    return experts, down.numel() // (experts * d_model)


def _build_plan(model, family: Family) -> Plan:
    config = _config(model)
    d_model = int(model.lm_head.weight.shape[-1])
    num_heads = int(getattr(model, "num_heads", None) or getattr(config, "num_attention_heads", None) or 0)
    layers = []
    for i, layer in enumerate(model.layers):
        layer_module = layer._module
        planned = []
        for term in layer_terms(family, layer):
            for path in (term.output.rsplit(".", 1)[0], term.projection, term.post_norm, term.outer_norm, term.scale,
                         term.bias, term.stream_scale, term.stream_bias, term.shared, term.shared_gate, term.router,
                         term.projection_bias, term.reads, term.then, term.hyper, term.stream_norm,
                         term.stream_norm_after, term.output_gate, term.position_conv,
                         term.projection_scale):
                if path and path not in ("output", "input") and not _has_path(layer, path):
                    raise FamilyTableError(
                        f"family {family.name!r}: block {i} ({type(layer_module).__name__}) has no {path!r} "
                        f"(term {term.name!r}); the family table entry does not describe this model"
                    )
            multiplier = _scalar(term.multiplier, config, i)
            parts = width = experts = expert_width = shared_width = 0
            routed_scale = shared_scale = 1.0
            transposed = False
            if term.router is not None:  # grouped experts: weight [E, d_model, in]
                module = module_at(layer, term.projection)._module
                experts, in_features = int(module.weight.shape[0]), int(module.weight.shape[-1])
                top_k = int(module_at(layer, term.router)._module.top_k)
                if term.split == "heads":
                    width = int(getattr(config, "kv_channels", None) or getattr(config, "head_dim"))
                    parts = top_k * in_features // width
                else:
                    expert_width = in_features
            elif term.split == "experts":
                experts, expert_width = _experts_shape(family, i, layer, term, d_model)
                if term.shared is not None:
                    shared_width = _linear_shape(module_at(layer, term.shared)._module)[0]
                layout = term.layout
                routed_scale = 1.0 if layout.routed_scale is None else config_value(config, layout.routed_scale)
                shared_scale = 1.0 if layout.shared_scale is None else config_value(config, layout.shared_scale)
            elif term.split is not None and term.projection is not None:
                module = module_at(layer, term.projection)._module
                in_features, _, transposed = _linear_shape(module)
                in_features *= int(getattr(module, "n_groups", 1))  # a grouped projection reads every group
                if term.split == "heads":
                    if in_features % num_heads:
                        raise FamilyTableError(
                            f"family {family.name!r}: block {i}: {term.projection} reads {in_features} features, "
                            f"not a multiple of {num_heads} heads"
                        )
                    parts, width = num_heads, in_features // num_heads
                else:
                    parts, width = in_features, 1
            parallel = bool(getattr(config, term.parallel)) if isinstance(term.parallel, str) else term.parallel
            planned.append(
                PlannedTerm(term, multiplier, parts, width, transposed, experts, expert_width, shared_width, parallel,
                            routed_scale, shared_scale, _scalar(term.stream_multiplier, config, i),
                            _scalar(term.projection_multiplier, config, i))
            )
        layers.append(tuple(planned))
    logit_scale = 1.0
    if family.logits_times is not None:
        logit_scale *= float(getattr(config, family.logits_times))
    if family.logits_over is not None:
        logit_scale /= float(getattr(config, family.logits_over))
    softcap = float(getattr(config, family.softcap)) if family.softcap and getattr(config, family.softcap, None) else None
    head_input_scale = 1.0 / float(getattr(config, family.head_input_over)) if family.head_input_over else 1.0
    return Plan(family, tuple(layers), logit_scale, softcap, num_heads, head_input_scale)
