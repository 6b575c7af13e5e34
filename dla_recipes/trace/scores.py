"""``attribute_scores`` inside the trace: one head's pre-softmax score split into query x key component pairs.

``score_attribution(model, plan, spec, q_positions, k_positions)`` runs inside ``with model.trace(...)`` (locally or
on an NDIF server) and returns a ``ScoreReadout`` of a few floats per pair. In forward order it reads what every
earlier component wrote at the query position ``q_positions [n]`` and the key positions ``k_positions [n, keys]``
(the embedding, each earlier term whole, or ``by="head"`` each head's slice of its output projection through any
post-norm frozen there), the block's attention norm ``ln1`` frozen at its real input at each of those positions, the
rotary ``cos`` / ``sin`` the attention module received, its q/k norms frozen at their real inputs, and the attention
call's own query and key (``attention_interface(...)``, read through nnsight's ``.source``: after rotary and norms).
Then each component is carried through ``ln1``, ``q_proj`` / ``k_proj``, the q/k norm and the model's own rotary
function, and the matrix is ``math.qk.score_matrix``. Three checks travel back with it: the components' sum against
the stream ``ln1`` read, the rebuilt query and key against the attention call's, and the norms' fit errors; the
model's own score is the call's query times its key times its scaling (plus a finite mask value: a position bias).

The host never waits for the device while the forward pass runs: the indices go to the device in one copy before
the first read (``Sites.on``), the checks stay 0-d tensors there, and the readout is gathered there and copied to
the host once, after a read of ``model.output`` (the later blocks and the head have run by then:
``ScoreReadout.gathered``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import DLAError
from ..math import qk
from ..math.frozen_norm import identity_probe, probe_norm
from ..math.linalg import relative_gap
from ..plan.build import module_at
from ..plan.plan import Plan
from ..plan.scores import ScoreSpec, splits_heads
from .kinds import pattern
from .readers import Sites, at, frozen_at, param, read_site
from .recipe import largest


def term_writes(layer, planned, by: str, sites: Sites, fits: list) -> list:
    """What one upstream term wrote at the sites, ``[n, d_model]`` each: the term whole, or ``by="head"`` each head
    then the term's rest (its biases through its post-norm)."""
    term, batch = planned.term, sites.batch
    write = term.write
    if not (by == "head" and splits_heads(planned)):
        value = at(read_site(layer, term.output, batch), sites)
        if write.bias is not None:
            value = value + param(layer, write.bias).to(value.device)
        if write.scale is not None:
            value = value * param(layer, write.scale).to(value.device)
        return [value * planned.multiplier]
    projection = module_at(layer, term.split.projection)
    z = at(read_site(projection, "input", batch), sites).flatten(1)  # [n, heads * head_dim]
    weight = projection.weight.float()
    weight = weight.T if planned.transposed else weight  # [d_model, heads * head_dim]
    heads = planned.parts
    bias = getattr(projection, "bias", None)
    rest = torch.zeros(weight.shape[0], device=z.device) if bias is None else bias.float().to(z.device)
    rest = rest.expand(z.shape[0], -1)
    with qk.exact():
        parts = torch.einsum("nhe,dhe->nhd", z.view(z.shape[0], heads, -1), weight.to(z.device).view(weight.shape[0], heads, -1))
    if write.post_norm is not None:
        post = frozen_at(module_at(layer, write.post_norm), sites)
        fits.append(post.fit_error)
        parts = qk.frozen_linear(post.gain, post.centers, post.scale[:, None], parts)
        rest = qk.frozen_linear(post.gain, post.centers, post.scale, rest) + post.bias.to(rest.device)
    if write.bias is not None:
        rest = rest + param(layer, write.bias).to(rest.device)
    return [parts[:, h] * planned.multiplier for h in range(heads)] + [rest * planned.multiplier]


def rows_of(tensor: torch.Tensor, sites: Sites) -> torch.Tensor:
    """``[n, ...]``: a ``[batch or 1, pos, ...]`` tensor at the sites (a batch of 1 broadcasts; the sites' indices
    on the device, ``Sites.on``)."""
    rows = sites.rows if tensor.shape[0] > 1 else torch.zeros_like(sites.rows)
    return tensor[rows.to(tensor.device), sites.positions.to(tensor.device)].float()


def position_embeddings(attention):
    """The ``(cos, sin)`` the attention module was called with, or None."""
    args, kwargs = attention.inputs
    found = kwargs.get("position_embeddings")
    if found is None and len(args) > 1 and isinstance(args[1], (tuple, list)):
        found = args[1]
    return found


def rotations(home: str | None, vectors: torch.Tensor, cos, sin, part: slice) -> list:
    """The readings of the rotary the attention may apply to ``vectors`` ``[m, C + 1, head_dim]``: the model's own
    ``apply_rotary_pos_emb`` on the whole head (its own partial or half-width rotary inside it), on the first
    ``cos``-wide features (partial rotary done by the caller, Phi), or none (NoPE layers: EXAONE-4's global ones).
    ``side`` keeps the one rebuilding the attention call's own query or key (all of one shape)."""
    if cos is None:
        return [vectors]
    function = sys.modules[home].apply_rotary_pos_emb
    found = [vectors]
    for width in dict.fromkeys((vectors.shape[-1], cos.shape[-1])):
        try:
            found.append(qk.rotate(function, vectors, cos[part], sin[part], width))
        except RuntimeError:  # a width the model's rotary does not take
            continue
    return found


def frozen_norm(norm, sites: Sites, fits: list, heads: int, seq: int) -> list:
    """A q/k norm frozen at its real input at the sites: its input ``[batch, pos, heads, head_dim]``, ``[batch, pos,
    heads * head_dim]`` or (Gemma-3, after the transpose) ``[batch, heads, pos, head_dim]``. As many heads as
    positions leaves the layout open: both readings are returned, and the one rebuilding the model's own query or key
    is kept (``side``)."""
    value, output = read_site(norm, "input", sites.batch), read_site(norm, "output", sites.batch)
    layouts = [False]
    if value.dim() == 4 and value.shape[1] == heads and value.shape[2] == seq:
        layouts = [True] if value.shape[1] != seq else [False, True]
    frozen = []
    for transposed in layouts:
        stream = at(value.transpose(1, 2) if transposed else value, sites)
        probe = probe_norm(norm, stream.shape[-1]).to(stream.device)
        frozen.append(probe.freeze(stream, at(output.transpose(1, 2) if transposed else output, sites)))
    fits.append(torch.stack([f.fit_error for f in frozen]).min())  # on the device: not read on the host here
    return frozen


class Side(NamedTuple):
    """One side of a head's score, the query or the key: its projection ``proj``, its frozen q/k norm's readings
    ``norms`` (``frozen_norm``'s; None: no norm), the sites it is read at (``part``, a slice of the sites), the head
    (``index`` of ``width`` heads) and the attention call's own vectors there (``real`` ``[m, head_dim]``)."""

    proj: object
    norms: list | None
    part: slice
    index: int
    width: int
    real: torch.Tensor


def side(of: Side, normed: torch.Tensor, bias: torch.Tensor, head_dim: int, rotary: tuple):
    """``(vectors [m, C + 1, head_dim], gap [])``: each component's query (or key) of head ``of.index`` at the sites
    ``of.part``, then what no component wrote, through the projection, the frozen q/k norm (the reading of
    ``of.norms`` rebuilding ``of.real``, the attention call's own, best) and the rotary (``(module name, cos, sin)``:
    the model's own ``apply_rotary_pos_emb`` at each site's position, read as ``rotations`` says; cos None: no
    rotary); ``gap`` is the rebuild's. The best reading is chosen on the device (``torch.where``: the first of the
    smallest gap), so nothing is read on the host while the forward pass runs."""
    proj, norms, part, index, width, real = of
    home, cos, sin = rotary
    x = qk.project(normed[part], proj.weight)  # [m, C, heads * head_dim]
    x0 = qk.project(bias[None], proj.weight).expand(x.shape[0], -1)
    if getattr(proj, "bias", None) is not None:
        x0 = x0 + proj.bias.float().to(x0.device)
    best = gap = None
    for norm in norms or [None]:
        y, y0 = through_norm(None if norm is None else SitesNorm(norm, part), x, x0, width)
        m = y.shape[0]
        y = y.view(m, y.shape[1], width, head_dim)[:, :, index]
        y0 = y0.view(m, width, head_dim)[:, index]
        both = torch.cat([y, y0[:, None]], 1)  # [m, C + 1, head_dim]
        for rotated in rotations(home, both, cos, sin, part):
            found = relative_gap(rotated.sum(1), real.to(rotated.device))
            if best is None:
                best, gap = rotated, found
                continue
            closer = found < gap  # [] bool on the device
            best, gap = torch.where(closer, rotated, best), torch.where(closer, found, gap)
    return best, gap


def through_norm(frozen, x: torch.Tensor, x0: torch.Tensor, heads: int):
    """``(components [n, C, width], constant [n, width])`` after a frozen q/k norm (per head or over all heads)."""
    n, count, width = x.shape
    if frozen is None:
        return x, x0
    if frozen.gain.shape[-1] == width:  # one norm over every head's features (OLMo-2), or one head in all (MQA)
        scale = frozen.scale[:n].reshape(n)
        return (qk.frozen_linear(frozen.gain, frozen.centers, scale[:, None], x),
                qk.frozen_linear(frozen.gain, frozen.centers, scale, x0) + frozen.bias.to(x0.device))
    head_dim = frozen.gain.shape[-1]
    scale = frozen.scale[:n]  # [n, heads]
    parts = qk.frozen_linear(frozen.gain, frozen.centers, scale[:, None], x.view(n, count, heads, head_dim))
    constant = qk.frozen_linear(frozen.gain, frozen.centers, scale, x0.view(n, heads, head_dim)) + frozen.bias.to(x0.device)
    return parts.reshape(n, count, width), constant.reshape(n, width)


def score_attribution(model, plan: Plan, spec: ScoreSpec, q_positions: torch.Tensor,
                      k_positions: torch.Tensor) -> ScoreReadout:
    """Split head ``spec.head`` of block ``spec.layer``'s score of each prompt's query (``q_positions [n]``, into the
    padded sequence) against its keys (``k_positions [n, keys]``); see the module docstring."""
    with torch.no_grad():
        block = model.layers[spec.layer]
        attention = module_at(block, spec.attention)
        family = pattern.family_of(attention)
        try:
            call = pattern.attention_call(attention, family)  # .source instrumented before the forward reaches it
        except DLAError as error:
            raise DLAError(f"attribute_scores reads the query and key from the attention call: {error}") from error
        n, keys = k_positions.shape
        # the indices go to the device in one copy, before the forward pass runs (the first read below): a copy from
        # host memory waits for the device, as a read of a result does
        device = module_at(attention, spec.q_proj).weight.device  # where the score is computed
        indices = torch.cat([torch.arange(n), q_positions.long(), k_positions.reshape(-1).long()]).to(device)
        rows, q_positions, key_positions = indices.split([n, n, n * keys])  # [n], [n], [n * keys]
        key_rows = rows[:, None].expand(n, keys).reshape(-1)  # [n * keys]: each key's prompt
        k_positions = key_positions.view(n, keys)
        stream = read_site(model.layers[0], "input")
        batch, seq = int(stream.shape[0]), int(stream.shape[1])
        sites = Sites.on(torch.cat([rows, key_rows]), torch.cat([q_positions, key_positions]), batch, seq)
        fits: list = []  # each a 0-d tensor on the device
        writes = [at(stream, sites)]
        for i, terms in enumerate(plan.terms_before(spec.stop)):
            for planned in terms:
                writes.extend(term_writes(model.layers[i], planned, spec.by, sites, fits))
        if spec.ln1 is None:  # the attention reads the stream itself: an identity norm
            entering = at(read_site(block, "input", batch), sites)
            frozen = identity_probe(entering.shape[-1], entering.device).freeze(entering, entering)
        else:
            ln1 = module_at(block, spec.ln1)
            entering = at(read_site(ln1, "input", batch), sites)
            probe = probe_norm(ln1, entering.shape[-1]).to(entering.device)
            frozen = probe.freeze(entering, at(read_site(ln1, "output", batch), sites))
        fits.append(frozen.fit_error)
        rotary = position_embeddings(attention)
        cos = sin = None
        if rotary is not None and spec.rotary is not None:
            cos, sin = rows_of(rotary[0], sites), rows_of(rotary[1], sites)
        q_norm = None if spec.q_norm is None else frozen_norm(module_at(attention, spec.q_norm), sites, fits,
                                                              spec.heads, seq)
        k_norm = None if spec.k_norm is None else frozen_norm(module_at(attention, spec.k_norm), sites, fits,
                                                              spec.kv_heads, seq)
        try:
            named = pattern.call_inputs(call, family, spec.heads)
        except DLAError as error:
            raise DLAError(f"attribute_scores reads the query and key from the attention call: {error}") from error
        query, key, mask = named["query"], named["key"], named.get("attention_mask")
        scaling = named.get("scaling")
        scaling = spec.head_dim ** -0.5 if scaling is None else float(scaling)
        softcap = named.get("softcap")
        real_q = query[rows.to(query.device), spec.head, q_positions.to(query.device)].float()  # [n, head_dim]
        real_k = key[key_rows.to(key.device), spec.kv_head, key_positions.to(key.device)].float()  # [n*keys, head_dim]
        bias, allowed = mask_at(mask, rows, q_positions, k_positions, named.get("sliding_window"))
        with qk.exact():
            written = torch.stack([w.to(entering.device) for w in writes], 1)  # [sites, C, d_model]
            stream_error = relative_gap(written.sum(1), entering)
            normed = qk.frozen_linear(frozen.gain, frozen.centers, frozen.scale[:, None], written)
            q_proj, k_proj = module_at(attention, spec.q_proj), module_at(attention, spec.k_proj)
            rotary = (spec.rotary, cos, sin)
            q_side, q_error = side(Side(q_proj, q_norm, slice(0, n), spec.head, spec.heads, real_q), normed,
                                   frozen.bias, spec.head_dim, rotary)
            k_side, k_error = side(Side(k_proj, k_norm, slice(n, None), spec.kv_head, spec.kv_heads, real_k), normed,
                                   frozen.bias, spec.head_dim, rotary)
            k_side = k_side.view(n, keys, *k_side.shape[1:])
            values, constant = qk.score_matrix(q_side[:, :-1], q_side[:, -1], k_side[:, :, :-1], k_side[:, :, -1],
                                               scaling)
            real_k = real_k.to(q_side.device).view(n, keys, -1)
            real_q = real_q.to(q_side.device)
            score = torch.einsum("nd,nkd->nk", real_q, real_k) * scaling
            bias = bias.to(score.device)
            size = values.abs().sum((2, 3)) + constant.abs()
            qk_size = real_q.norm(dim=-1)[:, None] * real_k.norm(dim=-1) * abs(scaling)
            checks = torch.stack([stream_error.to(device), q_error.to(device), k_error.to(device),
                                  largest(fits, device), torch.full((), float(softcap or 0.0), device=device)])
        # the end of the forward pass (the later blocks, the head): the one copy to the host below then waits for no
        # kernel the model still has to run
        model.output  # noqa: B018 (a read, not a useless expression: the trace waits here for the forward to end)
        return ScoreReadout(values, constant + bias, score + bias, allowed=allowed.float(), size=size, qk_size=qk_size,
                            checks=checks).gathered()


class SitesNorm:
    """A frozen q/k norm restricted to some of the sites (its scale's rows ``part``): what ``through_norm`` reads."""

    def __init__(self, frozen, part: slice):
        self.gain, self.centers, self.bias = frozen.gain, frozen.centers, frozen.bias
        self.scale = frozen.scale[part]


def mask_at(mask, rows: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor, window):
    """``(bias [n, keys], allowed [n, keys])``: the attention mask's value at each (query, key) pair: a finite value
    is added to the score (a position bias), a masked pair (padding, causality, a sliding window) is not allowed.
    On the device of the indices (``rows`` / ``q_positions`` ``[n]``, ``k_positions`` ``[n, keys]``)."""
    n, keys = k_positions.shape
    device = k_positions.device
    allowed = torch.ones(n, keys, dtype=torch.bool, device=device)
    bias = torch.zeros(n, keys, device=device)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        r = (rows if mask.shape[0] > 1 else torch.zeros_like(rows)).to(mask.device)
        q = (q_positions if mask.shape[2] > 1 else torch.zeros_like(q_positions)).to(mask.device)
        picked = mask[r[:, None], 0, q[:, None], k_positions.to(mask.device)].to(device)  # [n, keys]
        if picked.dtype == torch.bool:
            return bias, picked
        picked = picked.float()
        allowed = picked > torch.finfo(mask.dtype).min / 2
        return torch.where(allowed, picked, torch.zeros_like(picked)), allowed
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # a [batch, keys] padding mask (1: a real token)
        allowed = mask[rows[:, None].to(mask.device), k_positions.to(mask.device)].bool().to(device)
    allowed = allowed & (k_positions <= q_positions[:, None])
    if window is not None:
        allowed = allowed & (q_positions[:, None] - k_positions < int(window))
    return bias, allowed


@dataclass
class ScoreReadout:
    """What a trace sends back: ``values [n, keys, C, C]``, ``constant`` / ``score`` / ``allowed`` / ``size`` (the
    sum of the parts' sizes) / ``qk_size`` (``|q| |k| scaling``) ``[n, keys]``, and ``checks`` ``[5]``: the stream's,
    the query's and the key's relative rebuild gaps, the largest norm fit error, the attention soft-cap (0: none).

    ``packed`` (not compared): the host tensor ``gathered`` copied, which ``pack`` returns as it is."""

    values: torch.Tensor
    constant: torch.Tensor
    score: torch.Tensor
    allowed: torch.Tensor
    size: torch.Tensor
    qk_size: torch.Tensor
    checks: torch.Tensor
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def gathered(self) -> ScoreReadout:
        """This readout of a trace, brought to the host in one copy: its fields (on the device) packed into one
        tensor there and copied to the host once, after the forward pass: the only time the trace waits for the
        device."""
        n, keys, count = self.values.shape[:3]
        host = self.pack().cpu()
        return type(self).unpack(host, n, keys, count)

    def pack(self) -> torch.Tensor:
        """One flat float32 tensor on ``values``' device (``ScoreCall.unpack`` reads it back)."""
        if self.packed is not None:
            return self.packed
        device = self.values.device
        return torch.cat([t.float().reshape(-1).to(device) for t in (self.values, self.constant, self.score,
                                                                     self.allowed, self.size, self.qk_size,
                                                                     self.checks)])

    @classmethod
    def unpack(cls, packed: torch.Tensor, n: int, keys: int, count: int) -> ScoreReadout:
        """The inverse of ``pack`` for ``n`` queries of ``keys`` keys each, ``count`` components a side."""
        sizes = [n * keys * count * count] + [n * keys] * 5 + [5]
        pieces = list(torch.split(packed.reshape(-1), sizes))
        return cls(pieces[0].view(n, keys, count, count), *(p.view(n, keys) for p in pieces[1:6]), pieces[6],
                   packed=packed)


@dataclass(frozen=True)
class ScoreCall:
    """``score_attribution``'s arguments for one batch: ``call.run(model)`` in a trace, ``call.unpack(packed)`` after."""

    plan: Plan
    spec: ScoreSpec
    q_positions: torch.Tensor
    k_positions: torch.Tensor

    def run(self, model) -> ScoreReadout:
        """The split of this batch's scores, inside the running trace of ``model``."""
        return score_attribution(model, self.plan, self.spec, self.q_positions, self.k_positions)

    def unpack(self, packed: torch.Tensor) -> ScoreReadout:
        """The ``ScoreReadout`` a trace's ``pack()`` sent."""
        n, keys = self.k_positions.shape
        return ScoreReadout.unpack(packed, n, keys, len(self.spec.labels))
