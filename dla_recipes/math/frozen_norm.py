"""The frozen norm: any LayerNorm-like module turned into a linear map at the real stream it read.

A norm ``y = gain * center(x) * scale(x) + bias`` is linear in ``x`` except for one step, the per-position
``scale(x) = 1 / sqrt(mean(center(x)**2) + eps)``. Freezing that scale at the stream the model really fed the norm
makes the norm linear, so the parts of a decomposed stream pass through it one by one and still sum to its output.

``FrozenNorm`` learns the norm only by calling it (no family table, no weight names):

- on zeros it returns its ``bias`` (zeros for RMSNorm);
- on ones it returns the bias again exactly when it ``centers`` (subtracts the mean, as LayerNorm does);
- on a +/-1 vector (mean 0, mean square 1) it returns ``bias + gain * v / sqrt(1 + eps)``, which gives the ``gain``
  (``w`` for LayerNorm and RMSNorm, ``1 + w`` for Gemma's RMSNorm, ones for a LayerNorm without affine); ``eps`` is
  read off a second probe at a small amplitude, so no attribute name is needed.

The scale is then fitted at the real stream from the norm's real output (least squares per position), so the
frozen map reproduces the module's own output to rounding, in whatever precision the module computed it:
``frozen(stream) + frozen.bias == norm(stream)``. A low-precision output was rounded after the scale was applied,
and a fit to it carries that rounding into every part as one common factor (3.6e-4 on SmolLM2 in bfloat16): so in
bfloat16 / float16 the scale is recomputed in float32 from the stream itself, ``1 / sqrt(mean(center(x)**2) + eps)``
(as the model computes it), and kept when it agrees with the fit to the output's rounding (else the fit is kept:
a module of another form).

Every call here is an ordinary module call outside a trace, and an ad hoc envoy call inside one (nnsight stands
the trace down for it), so a ``FrozenNorm`` can be built server side in a remote trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .linalg import largest_abs

_SMALL_AMPLITUDE = 1e-2  # second probe for eps: large enough to stay exact in float32, small enough to feel eps


def _center(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True)


def _norm_dtype(norm) -> torch.dtype:
    for parameter in norm.parameters():
        return parameter.dtype
    return torch.float32


def _norm_device(norm) -> torch.device:
    for parameter in norm.parameters():
        return parameter.device
    return torch.device("cpu")


@dataclass
class NormProbe:
    """What probing a norm module revealed: ``norm(x) = gain * center(x) * scale(x) + bias``.

    Attributes:
        bias: ``[d_model]`` float32, the norm's output on zeros.
        gain: ``[d_model]`` float32, the per-channel gain (``w``, or ``1 + w`` on Gemma).
        centers: whether the norm subtracts the mean (LayerNorm) or not (RMSNorm).
        eps: the epsilon the probes imply (the scale is computed with it in low precision, else fitted).
        dtype: the dtype of the norm's weights (its output is rounded to it; float32 for a norm without weights).
    """

    bias: torch.Tensor
    gain: torch.Tensor
    centers: bool
    eps: float
    dtype: torch.dtype = torch.float32

    def center(self, x: torch.Tensor) -> torch.Tensor:
        """``center(x)`` on the last axis: the mean removed if the norm centers, ``x`` unchanged otherwise."""
        return _center(x) if self.centers else x

    def to(self, device) -> NormProbe:
        """The same probe with its tensors on ``device`` (a norm without parameters is probed on the CPU)."""
        return NormProbe(bias=self.bias.to(device), gain=self.gain.to(device), centers=self.centers, eps=self.eps,
                         dtype=self.dtype)

    def freeze(self, stream: torch.Tensor, output: torch.Tensor | None = None, norm=None) -> FrozenNorm:
        """Freeze the scale at ``stream`` ``[..., d_model]``; ``output`` is the norm's real output there (or call ``norm``)."""
        return FrozenNorm(norm, stream, output=output, probe=self)

    def fit(self, stream: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, fit_error)``: the scale ``[...]`` frozen at ``stream`` ``[..., d_model]``, fitted to the norm's
        real ``output`` there (least squares; in bfloat16 / float16 recomputed from the stream where they agree),
        and the fit's error ``[]`` (``FrozenNorm``'s, without making the module: what the recipe reads of the final
        norm). The probe's tensors must be on the stream's device (``to``)."""
        x = stream.float()
        y = output.float() - self.bias
        direction = self.gain * self.center(x)
        scale = (y * direction).sum(-1) / (direction * direction).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
        fitted = direction * scale.unsqueeze(-1)
        # max |fitted - y| over max |output| (each an infinity norm: one op, where abs then max is two), a 0-d tensor
        # on the stream's device: reading it as a float here would make the host wait for the device in the middle
        # of the forward pass (the recipe reads it once, with the result)
        fit_error = (largest_abs(fitted - y) / largest_abs(output).clamp_min(1e-30)
                     if output.numel() else torch.zeros((), device=x.device))
        if self.dtype in (torch.bfloat16, torch.float16) and output.numel():
            scale = _computed_scale(self, x, scale, torch.finfo(self.dtype).eps)
        return scale, fit_error


def identity_probe(width: int, device=None) -> NormProbe:
    """The probe of no norm at all (a family without a final norm): gain 1, bias 0, no centering; made on
    ``device`` (default: the CPU), not copied there."""
    return NormProbe(bias=torch.zeros(width, device=device), gain=torch.ones(width, device=device), centers=False,
                     eps=0.0)


PROBED = "_dla_recipes_probe"  # the attribute of a norm module that keeps its last probe (probe_norm)


def _probe_key(module, d_model: int) -> tuple:
    """What a norm's probe depends on: its parameters (each one's identity, storage and in-place version), dtype,
    device, and the width it reads."""
    return (d_model, *((id(p), p.data_ptr(), p._version, p.dtype, str(p.device)) for p in module.parameters()))


def probe_norm(norm, width: int | None = None) -> NormProbe:
    """Probe a norm module (or an nnsight envoy of one) with zeros, ones and a +/-1 vector; see the module docstring.

    ``width``: the width of the stream the norm reads, for a norm without weights (nanochat's RMSNorm), whose
    module cannot tell it; a norm that can tell its own width uses its own.

    The probe depends on the norm's weights only, so it is kept on the module (``PROBED``) and taken again only
    when a parameter changes (another tensor, or an in-place edit: its ``_version``), its dtype or its device:
    probing reads its results on the host, which in a trace would make it wait for the device mid-forward.
    """
    module = getattr(norm, "_module", norm)
    d_model = _width(module, width)
    key = _probe_key(module, d_model)
    kept = module.__dict__.get(PROBED)
    if kept is not None and kept[0] == key:
        return kept[1]
    probe = _probe(norm, module, d_model)
    module.__dict__[PROBED] = (key, probe)
    return probe


def forget_probes(module) -> None:
    """Drop the probe every norm of ``module`` keeps (a call asked with ``fast=Fast(probes=False)``: each norm is
    probed anew, the general path; ``tests/test_fast_paths.py``: the same numbers)."""
    for child in module.modules():
        child.__dict__.pop(PROBED, None)


def _probe(norm, module, d_model: int) -> NormProbe:
    dtype, device = _norm_dtype(module), _norm_device(module)
    weights = dtype
    with torch.no_grad():
        probes = torch.zeros(4, d_model, dtype=torch.float32)
        probes[1] = 1.0
        alternating = torch.ones(d_model, dtype=torch.float32)
        alternating[1::2] = -1.0
        if d_model % 2:  # keep the mean exactly 0 and the mean square exactly 1 on an odd width
            alternating[-1] = 0.0
            alternating *= (d_model / (d_model - 1)) ** 0.5
        probes[2] = alternating
        probes[3] = alternating * _SMALL_AMPLITUDE
        out, dtype = _call_at_compute_precision(norm, probes.to(device), dtype)
        bias = out[0]
        centers = bool(torch.allclose(out[1], bias, rtol=1e-3, atol=1e-5 * max(1.0, float(bias.abs().max()))))
        unit, small = out[2] - bias, out[3] - bias
        mask = alternating != 0
        # unit = g v / sqrt(1 + eps), small = g a v / sqrt(a^2 + eps): unit / small = sqrt(a^2 + eps) / (a sqrt(1 + eps)).
        live = mask & (small != 0)
        ratio = (unit[live] / small[live]).median() if bool(live.any()) else torch.tensor(1.0)
        ratio_sq = float(ratio) ** 2
        a_sq = _SMALL_AMPLITUDE**2
        eps = max(0.0, a_sq * (ratio_sq - 1.0) / (1.0 - ratio_sq * a_sq))
        gain = torch.zeros(d_model, dtype=torch.float32)
        gain[mask] = unit[mask] / alternating[mask] * (1.0 + eps) ** 0.5
        if not bool(mask.all()):  # the one zero entry of an odd-width probe: read it with a second, shifted probe
            shifted = torch.roll(alternating, 1)
            out_shifted = norm(shifted.to(device=device, dtype=dtype)[None]).float().cpu()[0] - bias
            gain[~mask] = out_shifted[~mask] / shifted[~mask] * (1.0 + eps) ** 0.5
    return NormProbe(bias=bias.to(device), gain=gain.to(device), centers=centers, eps=eps, dtype=weights)


def _call_at_compute_precision(norm, probes: torch.Tensor, dtype: torch.dtype):
    """``(norm(probes) [4, d_model] float32 on the CPU, the dtype used)``, at the precision the norm computes in.

    A low-precision norm is first called on float32 probes: a norm that computes in float32 (Llama's and Gemma's
    RMSNorm upcast; Gemma's gain ``1 + w`` is formed in float32) then returns its gain unrounded, where a bfloat16
    input would round ``1 + w`` to bfloat16 (up to 0.4% per channel). A norm that refuses a float32 input next to
    its low-precision weights (``nn.LayerNorm`` on the CPU) is called in its own dtype, as the model calls it.
    """
    if dtype != torch.float32:
        try:
            return norm(probes).float().cpu(), torch.float32
        except (RuntimeError, TypeError):
            pass
    return norm(probes.to(dtype)).float().cpu(), dtype


def _width(module, width: int | None = None) -> int:
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return int(shape[-1]) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[-1])
    for name in ("hidden_size", "dim", "d_model"):
        if isinstance(getattr(module, name, None), int):
            return getattr(module, name)
    if width is not None:  # a norm without weights: as wide as the stream it reads
        return int(width)
    raise ValueError(
        f"cannot tell the width of norm {type(module).__name__}: it has no weight or normalized_shape; "
        "pass probe_norm(norm, width=d_model)"
    )


def _computed_scale(probe: NormProbe, x: torch.Tensor, fitted: torch.Tensor, eps_out: float) -> torch.Tensor:
    """``[...]``: the scale ``1 / sqrt(mean(center(x)**2) + eps)`` computed in float32 from the stream ``x``, where
    it agrees with the ``fitted`` one to a few roundings of the output (``eps_out``: its dtype's machine epsilon);
    elsewhere the fitted scale."""
    centered = probe.center(x)
    computed = torch.rsqrt((centered * centered).mean(-1) + probe.eps)
    agrees = (computed / fitted.where(fitted != 0, torch.ones_like(fitted)) - 1).abs() <= 4 * eps_out
    return torch.where(agrees & (fitted != 0), computed, fitted)


class FrozenNorm(torch.nn.Module):
    """A norm frozen at the real stream it read: ``frozen(x) = gain * center(x) * scale``, linear in ``x``.

    Args:
        norm: the norm module, or its nnsight envoy (inside a trace).
        stream: ``[..., d_model]``, the real input of the norm (e.g. ``model.ln_final.input[rows, positions]``).
        output: ``[..., d_model]``, the norm's real output at the same places; computed by calling ``norm`` if omitted.
        probe: a ``NormProbe`` already taken of this norm (skips the probes).

    Attributes:
        scale: ``[...]`` float32, the frozen per-position scale (leading axes of ``stream``).
        bias, gain: ``[d_model]`` float32.  centers: bool.
        fit_error: ``[]`` max |frozen(stream) + bias - output|, relative to max |output| (a tensor on the stream's
            device): near float rounding for any LayerNorm / RMSNorm; a large value says the module is not a norm of
            this form.

    ``frozen(stream) + frozen.bias == norm(stream)``; for any ``x`` and direction ``v``,
    ``(frozen(x) * v).sum(-1) == (x * frozen.transpose(v)).sum(-1)``.
    """

    def __init__(self, norm, stream: torch.Tensor, output: torch.Tensor | None = None, probe: NormProbe | None = None):
        torch.nn.Module.__init__(self)  # explicit: nnsight ships this class by source, without a __class__ cell
        probe = (probe if probe is not None else probe_norm(norm, stream.shape[-1])).to(stream.device)
        with torch.no_grad():
            scale, fit_error = probe.fit(stream, output if output is not None else norm(stream))
        # plain attributes (no parameter, buffer or submodule among them): set at once, past Module.__setattr__'s
        # checks of each name (a frozen norm is made per call, in the forward pass)
        self.__dict__.update(probe=probe, fit_error=fit_error, bias=probe.bias, gain=probe.gain, centers=probe.centers,
                             scale=scale)

    def _scale_for(self, x: torch.Tensor) -> torch.Tensor:
        extra = x.dim() - 1 - self.scale.dim()
        if extra < 0:
            raise ValueError(f"input of shape {tuple(x.shape)} has fewer leading axes than the frozen scale {tuple(self.scale.shape)}")
        return self.scale.reshape(*self.scale.shape, *([1] * (extra + 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[*scale.shape, *extra, d_model] -> same``: ``gain * center(x) * scale`` (no bias: add ``.bias`` once)."""
        return self.gain * self.probe.center(x.float()) * self._scale_for(x)

    def transpose(self, v: torch.Tensor) -> torch.Tensor:
        """The adjoint map on directions ``[*scale.shape, *extra, d_model]``: ``scale * center(gain * v)``."""
        return self.probe.center(self.gain * v.float()) * self._scale_for(v)

    def extra_repr(self) -> str:
        kind = "centering (LayerNorm-like)" if self.centers else "non-centering (RMSNorm-like)"
        return f"{kind}, d_model={self.gain.shape[-1]}, scale shape={tuple(self.scale.shape)}"
