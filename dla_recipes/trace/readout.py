"""``Readout``: what one DLA trace returns, the wire format between the trace (local or on NDIF) and the client.

A few tensors per prompt whatever the model's width or the prompt's length; ``pack`` puts them in one
``[batch, n_components + len(Readout.FIELDS)]`` float32 tensor (the cheapest thing to send back from a server),
``unpack`` reverses it, ``concat`` joins the readouts of several batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# What a field the trace did not give reads (a granularity or precision without it: no pattern split, no rounding
# bound in float32, no head check on a direction): the dataclass's defaults, and what ``gathered`` writes.
DEFAULTS = {"head_error": 0.0, "pattern_error": 0.0, "pattern_layer": -1.0, "logit_size": 0.0, "head_noise": 0.0,
            "stream_noise": 0.0, "split_gap": 0.0, "split_noise": 0.0, "split_worst_gap": 0.0,
            "split_worst_allowed": 0.0, "split_worst_term": -1.0, "finite_head": 1.0, "first_nonfinite": -1.0,
            "unit_roundoff": 0.0, "weight_roundoff": 0.0, "add_ratio": 0.0, "add_where": -1.0, "add_gap": 0.0,
            "add_norm": 0.0}


def column(value: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """A field's value (``[n]``, ``[n, 1]`` or ``[]``) as ``[n]`` or ``[]`` on ``buffer``'s device (``gathered``)."""
    value = value if value.device == buffer.device else value.to(buffer.device)
    return value.reshape(-1) if value.dim() > 1 else value


def default(name: str):
    """What makes the default of the ``Readout`` field ``name``: ``DEFAULTS[name]``, a ``[]`` float32 tensor."""
    return lambda: torch.tensor(DEFAULTS[name])


@dataclass
class Readout:
    """What a DLA trace returns: a few tensors, whatever the model's width or the prompt's length.

    Attributes:
        values: ``[batch, n_components]`` float32, the components' contributions, in ``plan.labels(by)`` order.
        constant: ``[batch]`` the final norm's bias and ``lm_head``'s bias through the head (no component's).
        logit: ``[batch]`` the model's own logit (difference) before any soft-cap: ``lm_head``'s output times the
            family's logit scale, read in the same trace.
        output_logit: ``[batch]`` the model's output logit (difference), after any soft-cap.
        head_error: ``[]`` max |head(lm_head output) - output logits| at the attributed tokens: checks the family
            table's final head (logit scale, soft-cap).
        norm_fit_error: ``[]`` the largest relative fit error of a frozen norm (final and post-norms), and with
            ``by="source"`` of a head output rebuilt from the attention pattern and values.
        scale: ``[batch]`` the frozen scale of the norm the values were read through (the final norm for a logit).
        pattern_error, pattern_layer: ``[]`` ``by="source"``: the largest error of a block's heads rebuilt from its
            attention pattern and values against what its output projection reads (``max |sum_s A v - heads|`` over
            ``max |heads|``), and that block (-1: none split by source).

    What the self-check (``selfcheck``) needs to bound the model's own rounding, all ``[batch]`` in logit units:
        logit_size: ``b(z_target) + b(z_contrast)``, ``b(z) = 2^floor(log2 |z|)``: each logit is rounded at its own
            size (by at most ``u * b(z)``), not at the size of their difference.
        head_noise: ``sqrt(sum_i (y_i w_i)^2)``, ``y`` the final norm's output and ``w`` the head direction: the
            scale of that output's rounding, carried to the logit.
        stream_noise: ``s * sqrt(sum over adds, channels (x_i d_i)^2)``, ``x`` the stream around each residual add
            and ``d`` the direction it is read in: the scale of the adds' rounding, carried to the logit.
        split_gap: over the checked split terms (heads, neurons through one projection), what each wrote into the
            residual stream read along its direction, minus its parts and bias: the rounding of its low-precision
            output (0 when the call carries edits: then each split term's gap is its ``.edit`` column).
        split_noise: ``sqrt(sum over those terms, channels k (w_i u_i)^2)`` of those writes ``w``: its scale.
        split_worst_gap, split_worst_allowed, split_worst_term: the one checked split term whose gap most exceeds
            its own rounding: its gap, what its rounding allows (``SIGMAS * u * its noise``), and which term it is
            (``layer * 1024 + index in the block``; -1: none checked). Each term is held to its own rounding.
        finite_head: 1 where the head direction (final norm gain, ``lm_head`` rows) is finite, else 0.
        first_nonfinite: the first component (a column of ``values``) whose unscaled score is not finite, else -1.
        unit_roundoff: ``u`` of the dtype the model computed in, read where it ran (server side on NDIF, where the
            client's model has no weights and may not know it); 0 when unknown.
        weight_roundoff: ``u`` of the parameters' dtype, read there too (above ``unit_roundoff``: autocast).
        add_ratio, add_where, add_gap, add_norm: the per-add check (``math.adds``): the largest ratio of an add's
            gap to its own rounding at the first boundary where it exceeds 1 (else the worst), that boundary
            (``2 * block``: its adds; ``2 * block + 1``: the stream between it and the next reader; -1: none
            checked), the unexplained write's norm there and the stream's.

    ``buffer`` (not sent): the ``[batch, n_components + len(FIELDS)]`` tensor whose first columns ``values`` is
    (``recipe.joined``): ``pack`` writes the fields into its last columns instead of copying ``values`` again.
    """

    values: torch.Tensor
    constant: torch.Tensor
    logit: torch.Tensor
    output_logit: torch.Tensor
    head_error: torch.Tensor
    norm_fit_error: torch.Tensor
    scale: torch.Tensor
    pattern_error: torch.Tensor = field(default_factory=default("pattern_error"))
    pattern_layer: torch.Tensor = field(default_factory=default("pattern_layer"))
    logit_size: torch.Tensor = field(default_factory=default("logit_size"))
    head_noise: torch.Tensor = field(default_factory=default("head_noise"))
    stream_noise: torch.Tensor = field(default_factory=default("stream_noise"))
    split_gap: torch.Tensor = field(default_factory=default("split_gap"))
    split_noise: torch.Tensor = field(default_factory=default("split_noise"))
    split_worst_gap: torch.Tensor = field(default_factory=default("split_worst_gap"))
    split_worst_allowed: torch.Tensor = field(default_factory=default("split_worst_allowed"))
    split_worst_term: torch.Tensor = field(default_factory=default("split_worst_term"))
    finite_head: torch.Tensor = field(default_factory=default("finite_head"))
    first_nonfinite: torch.Tensor = field(default_factory=default("first_nonfinite"))
    unit_roundoff: torch.Tensor = field(default_factory=default("unit_roundoff"))
    weight_roundoff: torch.Tensor = field(default_factory=default("weight_roundoff"))
    add_ratio: torch.Tensor = field(default_factory=default("add_ratio"))
    add_where: torch.Tensor = field(default_factory=default("add_where"))
    add_gap: torch.Tensor = field(default_factory=default("add_gap"))
    add_norm: torch.Tensor = field(default_factory=default("add_norm"))
    buffer: torch.Tensor | None = field(default=None, repr=False, compare=False)  # values' own, with room (pack)
    gathered_into: torch.Tensor | None = field(default=None, repr=False, compare=False)  # gathered(): fields in it

    FIELDS = ("constant", "logit", "output_logit", "head_error", "norm_fit_error", "scale", "pattern_error", "pattern_layer",
              "logit_size", "head_noise", "stream_noise", "split_gap", "split_noise", "split_worst_gap",
              "split_worst_allowed", "split_worst_term", "finite_head", "first_nonfinite", "unit_roundoff",
              "weight_roundoff", "add_ratio", "add_where", "add_gap", "add_norm")

    def pack(self) -> torch.Tensor:
        """``[batch, n_components + len(FIELDS)]`` float32: everything in one tensor, the cheapest to send back."""
        batch, width = self.values.shape[0], self.values.shape[-1]
        buffer = self.buffer  # the recipe wrote the values into the first columns of a buffer with room: fill it
        if self.gathered_into is not None and self.gathered_into is buffer and self.values.data_ptr() == buffer.data_ptr():
            return buffer  # gathered(): the fields are in its last columns already
        if (buffer is not None and tuple(buffer.shape) == (batch, width + len(self.FIELDS))
                and buffer.dtype == torch.float32 and self.values.data_ptr() == buffer.data_ptr()
                and self.values.stride() == buffer.stride()):
            buffer[:, width:] = torch.stack(self.extra(batch), -1).to(buffer.device)
            return buffer
        return torch.cat([self.values.float(), torch.stack(self.extra(batch), -1)], -1)

    def extra(self, batch: int) -> list:
        """The fields, each ``[batch]`` float32 (a scalar repeated)."""
        return [getattr(self, name).float().reshape(-1).expand(batch) for name in self.FIELDS]

    @classmethod
    def gathered(cls, buffer: torch.Tensor, **fields) -> Readout:
        """The readout of a trace, brought to the host in one copy: ``buffer`` ``[n, n_components + len(FIELDS)]``
        holds the values in its first columns (``recipe.joined``), ``fields`` (each ``[n]`` or ``[]``, on any
        device; a missing one takes its default) are written into its last columns on the device, and the whole is
        copied to the host once, with the result: the only time the trace waits for the device.

        A handful of ops whatever the number of fields: the numbers known on the host and the columns of the tensor
        fields go to the device in one row (one upload), the row is copied into every row of the fields' columns,
        and the tensor fields, stacked ``[n, k]``, are copied into their columns by one ``index_copy_``."""
        width = len(cls.FIELDS)
        values = [fields[name] if name in fields else DEFAULTS[name] for name in cls.FIELDS]
        tensors = [j for j, v in enumerate(values) if isinstance(v, torch.Tensor)]
        row = torch.tensor([0.0 if isinstance(v, torch.Tensor) else float(v) for v in values]
                           + [float(j) for j in tensors]).to(buffer.device)
        out = buffer[:, buffer.shape[1] - width:]
        out.copy_(row[:width].expand_as(out))
        if tensors:
            stacked = torch.stack(torch.broadcast_tensors(*(column(values[j], buffer) for j in tensors)), -1)
            out.index_copy_(1, row[width:].long(), stacked.float().expand(out.shape[0], -1))
        host = buffer.cpu()
        readout = cls.unpack(host)
        readout.buffer = readout.gathered_into = host
        return readout

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> Readout:
        """The inverse of ``pack``."""
        k = len(cls.FIELDS)
        values, extra = packed[:, :-k], packed[:, -k:]
        scalars = dict(zip(cls.FIELDS, extra.unbind(-1)))
        scalars["head_error"] = scalars["head_error"].max()
        scalars["norm_fit_error"] = scalars["norm_fit_error"].max()
        scalars["pattern_error"], scalars["pattern_layer"] = scalars["pattern_error"][0], scalars["pattern_layer"][0]
        return cls(values=values, **scalars)

    @classmethod
    def concat(cls, readouts: list[Readout]) -> Readout:
        """One ``Readout`` of several batches' (in order): rows concatenated in float32, the two scalar checks
        (``head_error``, ``norm_fit_error``) their maximum."""
        if len(readouts) == 1:
            return readouts[0]
        scalars = ("head_error", "norm_fit_error")
        worst = max(readouts, key=lambda r: float(r.pattern_error))  # the batch whose rebuilt heads are worst
        rows = ("values",) + tuple(name for name in cls.FIELDS if name not in scalars + ("pattern_error", "pattern_layer"))
        return cls(
            **{name: torch.cat([getattr(r, name) for r in readouts]).float() for name in rows},
            **{name: torch.stack([getattr(r, name) for r in readouts]).max() for name in scalars},
            pattern_error=worst.pattern_error.float().reshape(()), pattern_layer=worst.pattern_layer.float().reshape(()),
        )
