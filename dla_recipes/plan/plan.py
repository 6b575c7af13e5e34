"""The plan: the family table resolved against one concrete model, and the components it attributes to.

A ``Plan`` is built client side (``plan.build``) from the model's config and module tree (a remote model built
without weights has both), travels into the trace as a small frozen dataclass, and tells the in-trace recipe what
to read, in forward order, and how each term splits. ``Plan.components(by)`` lists what an attribution's columns
are, as ``Component`` records (layer, term, part, index, source); the labels (``"L3.H5"``) are derived from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from ..args import Granularity, check_granularity
from ..components import Components, Labels, Run
from ..errors import InputError
from ..families import Family, Heads, Term

Kind = Literal["block", "linear", "conv", "routed", "experts"]


class Stop(NamedTuple):
    """A point in the residual stream: block ``layer`` after ``terms_added`` of its terms were added."""

    layer: int
    terms_added: int


@dataclass(frozen=True)
class Sources:
    """How ``by="source"`` splits heads: which heads are split over source positions, and into how many.

    Attributes:
        count: sources per split head, ``S0 .. S{count-1}``: indices into each prompt's own tokens (0 = its first
            token, whatever the padding); ``count`` is the largest attributed own position plus one, so a prompt
            whose attributed position is earlier has zeros for the sources it does not have.
        heads: the ``(layer, head)`` pairs split by source; None: every head. The other heads stay whole
            (``L3.H5``), as with ``by="head"``.
        upstream: ``"block"``: each ``(head, source)`` part split further by the component that wrote the source
            position's stream (``L3.H5.S2<-L1.mlp``, then the source's rest ``L3.H5.S2``); ``"head"``: the same
            with upstream attention split into heads (``L3.H5.S2<-L1.H0``; MLPs whole); None: not split.
    """

    count: int
    heads: frozenset | None = None
    upstream: str | None = None

    def split_heads(self, layer: int, heads: int) -> tuple[bool, ...]:
        """Which of block ``layer``'s ``heads`` are split by source."""
        if self.heads is None:
            return (True,) * heads
        return tuple((layer, h) in self.heads for h in range(heads))


@dataclass(frozen=True)
class PlannedTerm:
    """A ``Term`` with its constants and shapes resolved for one block.

    Attributes:
        term: the table's ``Term``.
        multiplier: ``config[term.write.multiplier]`` as a float (1.0 when none).
        parts: heads / neurons split: how many pieces ``projection.input`` splits into.
        part_width: the width of one piece (``head_dim`` for heads, 1 for neurons).
        transposed: the projection stores its weight ``[in, out]`` (GPT-2's ``Conv1D``) rather than ``[out, in]``.
        experts, expert_width: experts split: the number of routed experts and each one's neurons.
        shared_width: experts split: the shared expert's neurons (0: none).
        parallel: the sublayer reads the same stream as the term before it (``Term.parallel`` resolved).
        routed_scale, shared_scale: experts split: the layout's scales of the routed experts and the shared expert.
        stream_multiplier, projection_multiplier: ``Term.stream.multiplier`` / the split's
            ``projection_multiplier`` resolved to floats (1.0 when none).
        kind: how the in-trace recipe reads the term's parts, fixed here once (``trace.terms`` dispatches on it):
            ``"block"`` (never split), ``"linear"`` (heads / neurons through one projection), ``"conv"`` (the same
            under a position convolution), ``"routed"`` (grouped experts behind a router), ``"experts"`` (a fused
            mixture of experts, recomputed).
        bare: the split modes (``mode(by)``) at which the term has no rest column: nothing but its parts writes
            there (no bias on its write, its projections or its norms; ``plan.build.bare_modes``), so the column
            would be exactly zero, and its parts' labels name its block (``L3.H5`` is ``L3.attn``'s).
        dictionary: a ``features.Dictionary`` splitting this term into its latents at every granularity (mode
            ``"features"``: ``L3.mlp.F7``, ``L3.mlp.bias``, ``L3.mlp.skip``, ``L3.mlp.error``, then its rest);
            set per call by ``features.attach``, None in a built plan.
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
    kind: Kind = "block"
    bare: frozenset = frozenset()
    dictionary: object = None

    def mode(self, by: Granularity) -> str | None:
        """How this term splits at granularity ``by``: ``None`` (one component), ``"heads"``, ``"neurons"``,
        ``"experts"`` (one component per expert) or ``"expert_neurons"`` (one per neuron of every expert)."""
        term, split = self.term, self.term.split
        if self.dictionary is not None:
            return "features"
        if term.splits_heads and by == "head" and self.parts:
            return "heads"
        if isinstance(split, Heads) and by == "source" and self.parts:  # not grouped heads behind a router
            return "sources" if split.values else "heads"
        if term.splits_neurons and by == "neuron" and self.parts:
            return "neurons"
        if term.splits_experts and self.experts:
            return {"expert": "experts", "neuron": "expert_neurons"}.get(by)
        return None

    def components(self, i: int, by: Granularity, sources: Sources | None = None, edits: bool = False,
                   upstream: tuple = ()) -> list[Run]:
        """This term's components in block ``i``, as runs; the last is the term's rest (``part=None``), if it has one.

        ``by="source"``: ``L3.H5.S2`` (head 5's part read from the prompt's own token 2) for the heads ``sources``
        splits, ``L3.H5`` for the others. ``edits``: a split term has an ``L3.mlp.edit`` component before its rest
        (what it wrote beyond its parts and bias: an edit after its projection). A split term has no rest at the
        modes in ``bare`` (its parts and edit are then its last components). ``upstream``: with
        ``sources.upstream``, the labels of the components written before this term (each split source's parts
        ``L3.H5.S2<-L1.mlp``, then its rest ``L3.H5.S2``)."""
        mode, name = self.mode(by), self.term.name
        if mode == "features":  # its latents, the decoder bias, the skip path, the error, then its rest
            skip = [Run(i, name, "skip")] if self.dictionary.W_skip is not None else []
            return [Run(i, name, "feature", range(self.dictionary.width)), Run(i, name, "dropped"),
                    Run(i, name, "bias"), *skip,
                    Run(i, name, "error"), Run(i, name)]
        if mode == "sources":
            split = sources.split_heads(i, self.parts) if sources is not None else (False,) * self.parts
            parts = []
            for h in range(self.parts):
                if not split[h]:
                    parts.append(Run(i, name, "head", h))
                elif sources.upstream is None:
                    parts.append(Run(i, name, "head", h, range(sources.count)))
                else:
                    for s in range(sources.count):
                        parts += [Run(i, name, "head", h, s, upstream=upstream), Run(i, name, "head", h, s)]
        elif mode == "heads":
            parts = [Run(i, name, "head", range(self.parts))]
        elif mode == "neurons":
            parts = [Run(i, name, "neuron", range(self.parts))]
        elif mode == "experts":
            parts = [Run(i, name, "expert", range(self.experts))]
            parts += [Run(i, name, "shared")] if self.shared_width else []
        elif mode == "expert_neurons":
            parts = [Run(i, name, "neuron", range(self.expert_width), expert=e) for e in range(self.experts)]
            parts += [Run(i, name, "neuron", range(self.shared_width), expert="shared")]
        else:
            return [Run(i, name)]
        return parts + ([Run(i, name, "edit")] if edits else []) + ([] if mode in self.bare else [Run(i, name)])


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: the result caches its components per plan
class Plan:
    """What the in-trace recipe reads for one model. ``layers[i]`` lists block ``i``'s terms in forward order."""

    family: Family
    layers: tuple[tuple[PlannedTerm, ...], ...]
    logit_scale: float
    softcap: float | None
    num_heads: int
    head_input_scale: float = 1.0  # lm_head reads the final norm's output times this (``Family.head_input_over``)
    stream_dictionary: tuple | None = None  # (layer, features.Dictionary): the stream entering that block split by
    # its latents (``L16.resid.F3``, ``.bias``, ``.error``) in place of the embedding and every earlier term

    def components(self, by: Granularity = "block", stop: Stop | None = None,
                   sources: Sources | None = None, edits: bool = False) -> Components:
        """The components in forward order: the embedding, then each block's terms (split at ``by``; a split term
        keeps a component for its rest, unless nothing writes there: ``PlannedTerm.bare``). With ``stop``, only the terms written before it; ``sources``: how
        ``by="source"`` splits the heads; ``edits``: the forward pass may be edited, so each split term has an
        ``.edit`` component. A ``Components`` sequence: each ``Component`` is made when read."""
        check_granularity(by)
        runs, first = [Run(None, "embed")], 0
        if self.stream_dictionary is not None and stop is None:
            first, dictionary = self.stream_dictionary
            runs = [Run(first, "resid", "feature", range(dictionary.width)), Run(first, "resid", "dropped"),
                    Run(first, "resid", "bias"),
                    Run(first, "resid", "error")]
        for i, terms in enumerate(self.terms_before(stop)):
            for k, planned in enumerate(terms if i >= first else ()):
                upstream = ()
                if by == "source" and sources is not None and sources.upstream is not None:
                    upstream = tuple(self.components(sources.upstream, Stop(i, k)).labels())
                runs.extend(planned.components(i, by, sources, edits, upstream))
        return Components(runs)

    def labels(self, by: Granularity = "block", stop: Stop | None = None, sources: Sources | None = None) -> Labels:
        """The components' labels: ``embed``, ``L0.attn``, ``L0.mlp``, ... (``L3.H5`` / ``L3.N127`` / ``L3.E2`` /
        ``L3.E2.N17`` / ``L3.H5.S2`` when split; a split term keeps its block label for its rest where a bias writes
        there). A ``Labels`` sequence: each label is made when read."""
        return self.components(by, stop, sources).labels()

    def require(self, by: Granularity) -> Granularity:
        """``by``, checked to be a granularity this model has (``"expert"`` needs routed experts)."""
        check_granularity(by)
        if by == "expert" and not any(planned.mode(by) is not None for terms in self.layers for planned in terms):
            raise InputError(
                f"by='expert': this {self.family.name} model has no routed experts (no mixture-of-experts block); "
                "use by='block', 'head' or 'neuron'"
            )
        return by

    def terms_before(self, stop: Stop | None) -> list[tuple[PlannedTerm, ...]]:
        """Each block's terms written before ``stop`` (all of them when ``stop`` is None)."""
        if stop is None:
            return list(self.layers)
        layer, count = stop
        return list(self.layers[:layer]) + ([self.layers[layer][:count]] if count else [])

    def stop_before(self, layer: int, sublayer: str) -> Stop:
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
        return Stop(layer, k)
