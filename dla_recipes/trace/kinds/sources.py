"""Heads split by source position (``by="source"``): a linear heads term read through its attention pattern.

Head ``h`` writes ``sum_s A[h, s] v[s]`` through the output projection, linear in the values once the pattern ``A``
the model computed is read (the attention module's second output under eager attention; under sdpa or any other
implementation, recomputed at the sites from its attention call's query, key and mask: ``pattern``), so its part along the
pulled-back direction splits exactly into ``A[h, s] * (v[s] . pulled_h)``. Each split block's heads are rebuilt
from the pattern and the values, ``sum_s A v``, against the output projection's real input (``pattern_error``).
Which heads are split, and whether the model can be, is decided before the trace (``plan.sources``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import DLAError
from ...math.linalg import relative_gap
from ...plan.build import module_at
from ...plan.plan import PlannedTerm, Sources
from ..readers import Sites, at, read_site
from . import TermAt, pattern
from .linear import pull_back
from .pattern import per_prompt


@dataclass(frozen=True)
class SourceSplit:
    """``by="source"`` in one block: the plan's ``Sources`` (which heads split, into how many sources), the block,
    ``offsets`` ``[n]``: where each site's prompt's own tokens start in the padded sequence (on the device: copied
    there once, before the forward pass), and ``paths``: with
    ``Sources.upstream``, what every component wrote at the sources (each (head, source) part split by them)."""

    sources: Sources
    layer: int
    offsets: torch.Tensor
    paths: object = None  # sources=dict(upstream=...): the writes at the sources (``trace.kinds.paths.Paths``)

    def heads(self, count: int) -> tuple[bool, ...]:
        """Which of the block's ``count`` heads are split by source."""
        return self.sources.split_heads(self.layer, count)


@dataclass
class SourceReads:
    """What splitting heads by source needs, read in forward order.

    Attributes:
        values: ``[batch, pos, kv_heads, head_dim]`` the values at every position of every prompt.
        inputs: ``[n, heads * head_dim]`` the heads as the output projection reads them, at the sites.
        pattern: ``[n, heads, pos]`` the attention pattern at the sites.
        heads: ``[batch, pos, heads * head_dim]`` the output projection's input at every position.
        pattern_error: ``[]`` ``max |sum_s A v - heads| / max |heads|`` (the rebuilt heads against the model's own),
            on the device: read on the host with the result.
        sites: the sites read (``Sites``: each one's prompt, and each prompt's sites, ``Sites.groups``).
    """

    values: torch.Tensor
    inputs: torch.Tensor
    pattern: torch.Tensor
    pattern_error: torch.Tensor
    sites: Sites
    heads: torch.Tensor | None = None


def prepare(model, plan, sources: Sources) -> None:
    """Before the forward reaches them: source-instrument (nnsight's ``.source``) the attention module of every block
    with heads split by source whose attention returns no pattern, so its attention call's inputs can be read
    (``pattern.recompute``; a module already running when ``.source`` is first used would be read too late), and
    refuse a module without exactly one attention call (``pattern.attention_call``)."""
    for i, terms in enumerate(plan.layers):
        for planned in terms:
            if planned.mode("source") != "sources" or not any(sources.split_heads(i, planned.parts)):
                continue
            attention = module_at(model.layers[i], planned.term.split.projection.rsplit(".", 1)[0])
            if not pattern.returns_weights(attention):
                pattern.attention_call(attention, pattern.family_of(attention))


def read(layer, planned: PlannedTerm, mode: str, sites: Sites) -> SourceReads:
    """Read the values, the pattern and the heads, in forward order; rebuild the heads from pattern and values
    (``SourceReads.pattern_error``). The pattern is the attention module's own weights where it returns them
    (eager), else recomputed from its attention call's inputs (``pattern.recompute``: sdpa, flash, ...)."""
    heads, batch, rows, positions = planned.term.split, sites.batch, sites.rows, sites.positions
    values = read_site(layer, heads.values, batch).float()  # every position of every prompt
    attention = module_at(layer, heads.projection.rsplit(".", 1)[0])
    recomputed = None if pattern.returns_weights(attention) else pattern.recompute(
        attention, planned.parts, rows, positions, sites.groups)  # the attention call: before the output projection
    full = read_site(module_at(layer, heads.projection), "input", batch)
    inputs = at(full, sites).flatten(1)
    if recomputed is None:
        output = attention.output
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise DLAError(
                f"by='source' needs the attention pattern, and this model's attention ({heads.projection}'s module) "
                "returns none and names no attention implementation to recompute it from. Load the model with "
                "dla_recipes.load(..., attn_implementation='eager')"
            )
        recomputed = weights[rows.to(weights.device), :, positions.to(weights.device)].float()  # [n, heads, keys]
    weights = recomputed
    values = values_of(values, heads.values_layout, planned.parts, planned.part_width)
    rebuilt = grouped_sum(weights, values.to(weights.device), sites.groups).flatten(1)
    return SourceReads(values, inputs, weights, relative_gap(rebuilt, inputs), sites, full)


def values_of(fused: torch.Tensor, layout: str | None, heads: int, head_dim: int) -> torch.Tensor:
    """``[batch, pos, kv_heads, head_dim]``: the values in a value tensor or a fused projection's output
    (``Heads.values_layout``)."""
    batch, pos = fused.shape[:2]
    fused = fused.reshape(batch, pos, -1)
    if layout == "qkv":  # [queries | keys | values], keys and values of equal width
        fused = fused[..., heads * head_dim + (fused.shape[-1] - heads * head_dim) // 2:]
    elif layout == "per_head_qkv":  # [heads, (query, key, value)]
        fused = fused.view(batch, pos, heads, 3 * head_dim)[..., 2 * head_dim:]
    return fused.reshape(batch, pos, -1, head_dim)


def grouped_sum(pattern: torch.Tensor, values: torch.Tensor, groups: tuple) -> torch.Tensor:
    """``[n, heads, head_dim]``: ``sum_s A[h, s] v[s, group(h)]`` for each query head (GQA / MQA groups), at each
    site (``pattern [n, heads, keys]``, ``values [batch, pos, kv, head_dim]`` of the site's prompt: ``groups``,
    ``Sites.groups``)."""
    n, heads, keys = pattern.shape
    kv = values.shape[2]
    grouped = pattern.view(n, kv, heads // kv, keys)
    return per_prompt("nvgk,kvd->nvgd", grouped, values[:, :keys], groups).reshape(n, heads, -1)


def score(term: TermAt, reads: SourceReads, u: torch.Tensor, rest, split: SourceSplit):
    """``(parts [batch, parts], rest, None)``: each split head's part per own source position, the others whole.

    Source ``s`` of a prompt is padded position ``split.offsets[b] + s`` (a source past the padded length is zero),
    ``split.sources.count`` sources per split head.
    """
    layer, planned, _ = term
    pulled, rest, bias = pull_back(layer, planned, u, rest)
    heads_split, offsets, count = split.heads(planned.parts), split.offsets, split.sources.count
    heads, width = planned.parts, planned.part_width
    pattern, values = reads.pattern, reads.values.to(reads.pattern.device)
    u = pulled.to(pattern.device).view(-1, heads, width)
    whole = (reads.inputs.to(u.device).view(-1, heads, width) * u).sum(-1)  # [batch, heads]
    batch, _, keys = pattern.shape
    kv = values.shape[2]
    along = per_prompt("nvgd,kvd->nvgk", u.view(batch, kv, heads // kv, width), values[:, :keys], reads.sites.groups)
    per_source = pattern * along.reshape(batch, heads, keys)  # [batch, heads, padded keys]
    index = offsets.to(u.device)[:, None] + torch.arange(count, device=u.device)[None]  # [batch, count]
    inside = index < keys

    def at_sources(tensor):  # [batch, heads, padded keys] -> [batch, heads, count] at each prompt's own sources
        return tensor.gather(-1, index.clamp(max=keys - 1)[:, None].expand(-1, heads, -1)) * inside[:, None]

    own = at_sources(per_source)
    if split.paths is not None:  # each (head, source) part split by the components that wrote the source
        own = split.paths.split(term, split.layer, u, at_sources(pattern), own, reads.sites)
    pieces = [own[:, h] if heads_split[h] else whole[:, h:h + 1] for h in range(heads)]
    return torch.cat(pieces, -1), rest + bias, None
