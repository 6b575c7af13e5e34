"""Path parts (``by="source"``, ``sources=dict(upstream="block")``): each head's part from one source position, split
by the component that wrote that position's stream.

Head ``h``'s part from source ``s`` at a site is ``A[h, s] * (v_s . u_h)`` (``sources.score``: ``u_h``
``[head_dim]`` the direction pulled back onto the head). The value ``v_s = W_v^h y_s + b_v^h`` is linear in the
output ``y_s`` of the block's input norm, frozen at its real input ``x_s``: ``y_s = scale_s * gain * center(x_s) +
beta`` (no norm: ``y_s = x_s``). ``x_s`` is the sum of what the embedding and every earlier term wrote at ``s``,
``c_s`` each (``Paths.collect``: ``[batch, sources, d_model]`` a term, read as the forward pass writes it), so

    part(h, s, c) = A[h, s] * scale_s * (c_s . g_h)        g_h = center(gain * W_v^h^T u_h)   [d_model]
    rest(h, s)    = A[h, s] * (beta . W_v^h^T u_h + b_v^h . u_h)

sum to the ``(h, s)`` part exactly: one ``[d_model]`` pull-back per (site, head), whatever the source. Values-side
rotary embeddings do not exist (rotary acts on queries and keys); a value norm or a stream that is not the plain sum
of the writes is refused before the trace (``plan.sources.check_upstream``). Two relative errors join the fit
errors (``Paths.errors``): the writes' sum against the norm's real input at the sources, and the parts' sum against
the ``(h, s)`` part from the model's own values; a wrong sum also fails the self-check of the whole attribution.
"""

from __future__ import annotations

import torch

from ...math.frozen_norm import probe_norm
from ...math.linalg import exact
from ...plan.build import module_at
from ...plan.plan import PlannedTerm
from ..readers import read_site
from .pattern import per_prompt
from .sources import values_of


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 for empty tensors)."""
    if not b.numel():
        return 0.0
    return float((a - b.to(a.device)).abs().max() / b.abs().max().clamp(min=1e-30))


class Paths:
    """The writes every component made at every prompt's source positions, collected in forward order.

    ``offsets`` / ``rows`` ``[n]``: where each site's prompt's own tokens start, and its prompt; ``count`` sources
    a prompt (``S0 .. S{count-1}``: padded position ``offset + s``; past the padded length, zero).

    Attributes:
        index: ``[batch, count]`` each prompt's source positions in the padded sequence.
        writes: ``[batch, count, d_model]`` each: the embedding's, then each term's, in forward order.
        norms: block -> ``(frozen input norm or None, how many writes came before its heads)``.
        errors: the relative errors kept as fit errors (see the module docstring).
    """

    def __init__(self, offsets: torch.Tensor, rows: torch.Tensor, batch: int, count: int):
        starts = torch.zeros(batch, dtype=torch.long).scatter(0, rows.long().cpu(), offsets.long().cpu())
        self.index = starts[:, None] + torch.arange(count)[None]
        self.batch, self.count = batch, count
        self.writes: list = []
        self.norms: dict = {}
        self.errors: list = []

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """``[batch, count, d_model]`` float32 of a ``[batch, pos, d_model]`` value at the source positions (a source
        past the padded length reads the last position: its pattern weight is zero)."""
        index = self.index.to(value.device).clamp(max=value.shape[1] - 1)
        return value.gather(1, index[..., None].expand(-1, -1, value.shape[-1])).float()

    def collect(self, value: torch.Tensor) -> None:
        """Keep a write ``[batch, pos, d_model]`` at the source positions."""
        self.writes.append(self.gather(value))

    def read_norm(self, layer, planned: PlannedTerm, i: int) -> None:
        """Before block ``i``'s values are read: its heads' input norm (``Term.reads``) frozen at the sources, and
        the writes so far against the stream it reads."""
        frozen = None
        if planned.term.reads is None:  # the values read the stream itself
            stream = self.gather(read_site(layer, "input", self.batch))
        else:
            norm = module_at(layer, planned.term.reads)
            stream = self.gather(read_site(norm, "input", self.batch))
            output = self.gather(read_site(norm, "output", self.batch))
            frozen = probe_norm(norm, stream.shape[-1]).freeze(stream.flatten(0, 1), output.flatten(0, 1))
            self.errors.append(frozen.fit_error)
        with exact():
            total = torch.stack([w.to(stream.device) for w in self.writes]).sum(0)
            self.errors.append(relative(total, stream))
        self.norms[i] = (frozen, len(self.writes))

    def split(self, layer, planned: PlannedTerm, i: int, u: torch.Tensor, weights: torch.Tensor,
              own: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[n, heads, count * (upstream + 1)]``: each (head, source) part ``own`` ``[n, heads, count]`` split by
        the writes before block ``i``'s heads, then its rest, per source; ``u`` ``[n, heads, head_dim]`` the heads'
        directions, ``weights`` ``[n, heads, count]`` the pattern at the sources, ``rows`` ``[n]`` the prompts."""
        heads, width = planned.parts, planned.part_width
        split = planned.term.split
        module = module_at(layer, split.values.rsplit(".", 1)[0])
        weight, bias = module.weight, getattr(module, "bias", None)
        frozen, upstream = self.norms[i]
        device = u.device
        with exact():
            weight = weight.float().to(device)
            weight = values_of((weight if planned.transposed else weight.T)[None], split.values_layout, heads,
                               width)[0]  # [d_model, kv, head_dim]
            n, kv = u.shape[0], weight.shape[1]
            grouped = u.view(n, kv, heads // kv, width)
            pulled = torch.einsum("ivd,nvgd->nvgi", weight, grouped).reshape(n, heads, -1)  # W_v^T u
            rest = torch.zeros(n, heads, device=device)
            if bias is not None:
                bias = values_of(bias.float().to(device)[None, None], split.values_layout, heads, width)[0, 0]
                rest = rest + torch.einsum("vd,nvgd->nvg", bias, grouped).reshape(n, heads)
            scale = torch.ones(self.batch, self.count, device=device)
            if frozen is not None:
                rest = rest + (pulled * frozen.bias.to(device)).sum(-1)
                pulled = frozen.probe.center(frozen.gain.to(device) * pulled)
                scale = frozen.scale.to(device).view(self.batch, self.count)
            writes = torch.stack([w.to(device) for w in self.writes[:upstream]], 2)  # [batch, count, C, d_model]
            rows = rows.to(device)
            parts = per_prompt("nhd,scd->nhsc", pulled, writes, rows) * (weights * scale[rows][:, None])[..., None]
            rest = weights * rest[..., None]  # [n, heads, count]
            self.errors.append(relative(parts.sum(-1) + rest, own))
            return torch.cat([parts, rest[..., None]], -1).flatten(2)
