"""Term kind ``"features"``: a term (or the stream entering a block) split by a dictionary's latents, in the trace.

A term carrying a ``features.Dictionary`` (``PlannedTerm.dictionary``) is read whole, as an unsplit term is, along
its direction ``u`` ``[n, d_model]`` (pulled back through every later map and frozen norm), plus, for a transcoder,
what its sublayer reads (its norm's output, read first: it comes first in the forward pass). The latents ``a =
encode(x)`` ``[n, d_sae]`` of the dictionary's input ``x`` (the write itself, or the sublayer's input) give

    parts = a * (W_dec @ u^T)^T        [n, d_sae]   (W_dec @ u^T: [d_sae, n], once per call and term)
    dropped = 0                        [n]          (the wire's: ``trace.sparse``)
    bias  = b_dec @ u                  [n]
    skip  = x @ (u @ W_skip)           [n]          (a skip transcoder)
    error = write @ u - parts.sum - bias - skip     (the write as the model really made it: an edit included)

in float32, so the columns sum to the term's whole part ``write @ u`` to float32 rounding. No ``[n, d_sae,
d_model]`` is built. In the trace every latent is a column (an inactive one is exactly 0), as every neuron is at
``by="neuron"``; only the ``keep`` largest parts a site leave it (``trace.sparse``: the wire).
``stream_scores`` does the same for the stream entering a block (no skip, no rest), and ``placed`` moves a plan's
dictionaries to the model's device once, before the forward pass reads anything (no copy from the host in it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...math.linalg import dot, exact
from ...plan.build import module_at
from ...plan.plan import Plan, PlannedTerm
from ..readers import Sites, at, layer_input, read_site
from . import TermAt

# The kind is scored along the direction on the term's write itself, read whole (``value``), not through its
# projection: ``trace.terms`` reads and scores every kind the same way and asks only this.
ON_WRITE = True


@dataclass
class FeatureReads:
    """What a dictionary split reads, in forward order: ``inputs`` ``[n, d_model]`` what a transcoder's sublayer
    reads (its norm's output; None for an SAE, which reads the write), then ``value`` ``[n, d_model]`` the term's
    write, whole; both in the model's dtype."""

    inputs: torch.Tensor | None = None
    value: torch.Tensor | None = None


def read(layer, planned: PlannedTerm, mode: str, sites: Sites) -> FeatureReads:
    """Read a transcoder's input (the output of the norm its sublayer reads the stream through), then the term's
    write, at the sites."""
    inputs = None
    if planned.dictionary.reads == "input":
        inputs = at(read_site(module_at(layer, planned.term.reads), "output", sites.batch), sites, keep=True)
    return FeatureReads(inputs, at(read_site(layer, planned.term.output, sites.batch), sites, keep=True))


def split(dictionary, x: torch.Tensor, written: torch.Tensor, u: torch.Tensor, skip: bool) -> torch.Tensor:
    """``[n, d_sae + 3 (+1)]``: the latents' parts, the dropped ones (0 here: ``trace.sparse`` fills it on the
    wire), the decoder bias, (the skip path,) the error, along ``u``
    ``[n, d]``, of a dictionary reading ``x`` ``[n, d_in]`` for a write ``written`` ``[n, d]``."""
    with exact():  # float32 products under a caller's autocast (NDIF's) too
        x = x.float()
        acts = dictionary.encoder(x).float()  # [n, d_sae]
        pulled = dictionary.W_dec.float() @ u.t()  # [d_sae, n]: W_dec @ u once, never [n, d_sae, d]
        parts = acts * pulled.t()
        bias = dot(u, dictionary.b_dec.float())
        columns = [parts, parts.new_zeros(parts.shape[0], 1), bias.unsqueeze(-1)]  # dropped: 0 until the wire
        rebuilt = parts.sum(-1) + bias
        if skip:
            through = (x * (u @ dictionary.W_skip.float())).sum(-1)  # (W_skip x) . u = x . (u W_skip)
            columns.append(through.unsqueeze(-1))
            rebuilt = rebuilt + through
        error = dot(written, u) - rebuilt
        return torch.cat(columns + [error.unsqueeze(-1)], -1)


def score(term: TermAt, reads: FeatureReads, u: torch.Tensor, rest, split_heads=None):
    """``(parts [n, d_sae + 3 (+1)], rest, None)``: the term's latents' parts, decoder bias, skip and error along
    ``u`` on its write (``reads.value``), as every kind's ``score`` returns its parts; the rest is the term's own
    (its write's bias), unchanged."""
    d, value = term.planned.dictionary, reads.value
    x = value if reads.inputs is None else reads.inputs
    return split(d, x, value, u.to(value.device), d.W_skip is not None), rest, None


def stream_scores(model, plan: Plan, sites: Sites, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [n, d_sae + 3], stream [n, d_model])``: the stream entering block ``plan.stream_dictionary[0]``
    split by its dictionary along ``v`` (the direction on that stream), and the stream read there (float32)."""
    layer, d = plan.stream_dictionary
    stream = at(layer_input(model, layer), sites)
    return split(d, stream, stream, v.to(stream.device), False), stream


def placed(plan: Plan, device) -> Plan:
    """``plan`` with every dictionary on ``device`` in float32 (itself when there is none or they are there)."""
    moved = {}

    def place(d):  # .to of a tensor already there in float32 is the tensor itself (no copy)
        if id(d) not in moved:
            moved[id(d)] = d.to(device=device, dtype=torch.float32)
        return moved[id(d)]

    if plan.stream_dictionary is None and not any(p.dictionary is not None for block in plan.layers for p in block):
        return plan
    layers = tuple(tuple(p if p.dictionary is None else replace(p, dictionary=place(p.dictionary)) for p in block)
                   for block in plan.layers)
    stream = None if plan.stream_dictionary is None else (plan.stream_dictionary[0], place(plan.stream_dictionary[1]))
    return replace(plan, layers=layers, stream_dictionary=stream)
