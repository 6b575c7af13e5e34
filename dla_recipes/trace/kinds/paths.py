"""Path parts (``by="source"``, ``sources=dict(upstream="block")``): each head's part from one source position, split
by the component that wrote that position's stream.

Head ``h``'s part from source ``s`` at a site is ``A[h, s] * (v_s . u_h)`` (``sources.score``: ``u_h``
``[head_dim]`` the direction pulled back onto the head). The value ``v_s = W_v^h y_s + b_v^h`` is linear in the
output ``y_s`` of the block's input norm, frozen at its real input ``x_s``: ``y_s = scale_s * gain * center(x_s) +
beta`` (no norm: ``y_s = x_s``). ``x_s`` is the sum of what the embedding and every earlier term wrote at ``s``,
``c_s`` each (``Paths.collect``: ``[batch, sources, d_model]`` a term, read as the forward pass writes it), so

    part(h, s, c) = A[h, s] * scale_s * (c_s . g_h)        g_h = center(gain * W_v^h^T u_h)   [d_model]
    rest(h, s)    = A[h, s] * (beta . W_v^h^T u_h + b_v^h . u_h)

sum to the ``(h, s)`` part exactly: one ``[d_model]`` pull-back per (site, head), whatever the source. With
``upstream="head"`` an earlier attention's write is kept as its heads ``z [batch, sources, heads * head_dim]`` (its
output projection's input) and ``g_h`` is pulled back through that projection too: one column per upstream head,
then its bias's. Where a post-norm lies between that projection and the stream (Gemma-2/3, OLMo-2: ``Write.post_norm``)
it is frozen at its real input at the sources, ``o_s -> scale'_s * gain' * center(o_s) + beta'``, a linear map, so
``g_h`` is pulled back through it first: head ``k``'s column is ``scale'_s * (center(gain' * g_h) . W_O^k z_k[s])``
and the bias column holds ``scale'_s * (center(gain' * g_h) . b_O) + beta' . g_h`` (``HeadsWrite``). Values-side
rotary embeddings do not exist (rotary acts on queries and keys); a value norm or a stream that is not the plain sum
of the writes is refused before the trace (``plan.sources.check_upstream``). Two relative errors join the fit
errors (``Paths.errors``): the writes' sum against the norm's real input at the sources, and the parts' sum against
the ``(h, s)`` part from the model's own values; a wrong sum also fails the self-check of the whole attribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...math.frozen_norm import FrozenNorm, probe_norm
from ...math.linalg import exact, linear_pullback, relative_gap
from ...plan.build import module_at
from ...plan.plan import PlannedTerm
from ..readers import read_site, term_write
from . import TermAt
from .pattern import per_prompt
from .sources import values_of


@dataclass
class HeadsWrite:
    """An upstream attention kept by head (``upstream="head"``), at the sources.

    Attributes:
        z: ``[batch, count, heads * head_dim]`` its output projection's input.
        projection: the output projection (envoy).
        planned: its ``PlannedTerm``.
        post_norm: the post-norm between the projection and the stream, frozen at its real input at the sources
            (scale ``[batch * count]``), or None.
    """

    z: torch.Tensor
    projection: object
    planned: PlannedTerm
    post_norm: FrozenNorm | None = None

    def whole(self, device) -> torch.Tensor:
        """``[batch, count, d_model]``: what the heads wrote to the stream, rebuilt from ``z`` (the projection, its
        bias, the frozen post-norm and its bias, the multiplier; weights read outside ``exact()``)."""
        weight, bias = self.projection.weight, getattr(self.projection, "bias", None)
        with exact():
            w = weight.float().to(device)
            out = self.z.to(device) @ (w if self.planned.transposed else w.T)
            out = out + (0.0 if bias is None else bias.float().to(device))
            if self.post_norm is not None:
                batch, count = out.shape[:2]
                out = (self.post_norm(out.flatten(0, 1)) + self.post_norm.bias).view(batch, count, -1)
            return out * self.planned.multiplier


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

    def __init__(self, offsets: torch.Tensor, rows: torch.Tensor, batch: int, count: int, heads: bool = False):
        """``offsets`` / ``rows`` on the device the values are read on (the index is built there: nothing is
        copied from the host while the forward pass runs)."""
        starts = torch.zeros(batch, dtype=torch.long, device=rows.device).scatter(0, rows.long(), offsets.long())
        self.index = starts[:, None] + torch.arange(count, device=rows.device)[None]
        self.batch, self.count, self.heads = batch, count, heads
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

    def by_head(self, planned: PlannedTerm) -> bool:
        """Whether ``planned``'s write is kept per head (``upstream="head"``: heads through one projection)."""
        return self.heads and planned.mode("head") == "heads"

    def before(self, layer, planned: PlannedTerm, mode: str | None, i: int) -> None:
        """Before block ``i``'s term is read: its heads' input norm (a term split by source), or the heads of a
        term read whole (``upstream="head"``: its projection's input, read first in the forward)."""
        if mode == "sources":
            self.read_norm(layer, planned, i)
        elif self.by_head(planned):
            projection = module_at(layer, planned.term.split.projection)
            self.writes.append(HeadsWrite(self.gather(read_site(projection, "input", self.batch).flatten(2)),
                                          projection, planned))

    def after(self, layer, planned: PlannedTerm, mode: str | None, reads) -> None:
        """After the term is read: keep its write, or its heads (from a term split by source, as it read them),
        with its post-norm frozen at the sources (from the post-norm's input and output the term's reads kept)."""
        if not self.by_head(planned):
            self.collect(term_write(layer, planned.term, planned.multiplier, self.batch))
            return
        if mode == "sources":
            projection = module_at(layer, planned.term.split.projection)
            self.writes.append(HeadsWrite(self.gather(reads.parts.heads.flatten(2)), projection, planned))
        if planned.term.write.post_norm is not None:
            stream, output = (self.gather(value).flatten(0, 1) for value in reads.post_norm_io)
            norm = module_at(layer, planned.term.write.post_norm)
            self.writes[-1].post_norm = probe_norm(norm, stream.shape[-1]).freeze(stream, output)
            self.errors.append(self.writes[-1].post_norm.fit_error)

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
        total = torch.zeros_like(stream)
        for write in self.writes:
            if isinstance(write, HeadsWrite):  # heads: what they wrote, rebuilt
                write = write.whole(stream.device)
            with exact():
                total = total + write.to(stream.device)
        self.errors.append(relative_gap(total, stream))
        self.norms[i] = (frozen, len(self.writes))

    def split(self, term: TermAt, i: int, u: torch.Tensor, weights: torch.Tensor, own: torch.Tensor,
              sites) -> torch.Tensor:
        """``[n, heads, count * (upstream + 1)]``: each (head, source) part ``own`` ``[n, heads, count]`` split by
        the writes before block ``i``'s heads, then its rest, per source; ``u`` ``[n, heads, head_dim]`` the heads'
        directions, ``weights`` ``[n, heads, count]`` the pattern at the sources, ``sites`` the ``Sites`` read
        (each one's prompt, and each prompt's sites); ``term``: block ``i``'s heads term."""
        layer, planned, _ = term
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
            rows, groups = sites.rows.to(device), sites.groups
        columns, plain = [], []
        for write in self.writes[:upstream] + [None]:
            if plain and not isinstance(write, torch.Tensor):  # a run of whole writes: [n, heads, count, run]
                with exact():
                    plain_writes = torch.stack([w.to(device) for w in plain], 2)  # [batch, count, run, d_model]
                    columns.append(per_prompt("nhd,scd->nhsc", pulled, plain_writes, groups))
                plain = []
            if isinstance(write, torch.Tensor):
                plain.append(write)
            elif write is not None:
                columns.append(self.head_columns(write, pulled, rows, groups))
        with exact():
            parts = torch.cat(columns, -1) * (weights * scale[rows][:, None])[..., None]
            rest = weights * rest[..., None]  # [n, heads, count]
            self.errors.append(relative_gap(parts.sum(-1) + rest, own))
            return torch.cat([parts, rest[..., None]], -1).flatten(2)

    def head_columns(self, write: HeadsWrite, pulled: torch.Tensor, rows: torch.Tensor, groups: tuple) -> torch.Tensor:
        """``[n, heads, count, upstream heads (+ 1)]``: an upstream term's heads along each site's and head's
        ``pulled`` ``[n, heads, d_model]``, through its frozen post-norm where it has one, then its bias's column
        where the term has one (``PlannedTerm.bare``); ``rows`` ``[n]`` each site's prompt."""
        term, post = write.planned, write.post_norm
        n, heads = pulled.shape[:2]
        flat = pulled.reshape(n * heads, -1)
        scale, beta = None, 0.0
        if post is not None:  # pulled back through the frozen post-norm: its scale per source, its bias a constant
            with exact():
                beta = (flat * post.bias.to(flat.device)).sum(-1).view(n, heads, 1, 1)
                flat = post.probe.center(post.gain.to(flat.device) * flat)
                scale = post.scale.to(flat.device).view(self.batch, self.count)[rows][:, None, :, None]
        back, constant = linear_pullback(write.projection, flat, term.transposed)
        with exact():
            back = back.to(pulled.device).view(n, heads, term.parts, term.part_width) * term.multiplier
            z = write.z.to(pulled.device).view(self.batch, self.count, term.parts, term.part_width)
            out = per_prompt("nhkd,skd->nhsk", back, z, groups)
            if scale is not None:
                out = out * scale
            if "heads" not in term.bare:
                bias = torch.as_tensor(constant, device=out.device).float().reshape(-1)
                bias = bias.expand(n * heads).reshape(n, heads, 1, 1).expand(n, heads, self.count, 1)
                if scale is not None:
                    bias = bias * scale
                out = torch.cat([out, (bias + beta) * term.multiplier], -1)
            return out
