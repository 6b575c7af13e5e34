"""Linear algebra of the recipe: dot products, float32 matmuls over low-precision weights, pulling a direction back.

Tensors in, tensors out; nothing here knows a family. ``matmul_f32`` never holds a float32 copy of a whole
low-precision weight: it converts a slice of rows at a time (``CHUNK_ELEMENTS``).

``exact()`` switches off the caller's autocast around the recipe's own products: NDIF runs every request inside
``torch.autocast("cuda", dtype=<model dtype>)``, which would turn a float32 matmul of the recipe into a bfloat16
one. Only pure arithmetic runs inside it (no read of the running model: a read hands control to the model's
forward, which must keep the caller's autocast).
"""

from __future__ import annotations

import contextlib

import torch


class exact:
    """Autocast off (CUDA and CPU, where it is on) for the arithmetic inside: float32 stays float32.

    A class, not a ``contextlib.contextmanager``: a remote trace ships the functions it calls by their source, and
    a generator function's decorator does not travel with it."""

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for device in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device):
                self.stack.enter_context(torch.autocast(device, enabled=False))
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def dot(a: torch.Tensor, b: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """``[batch]``: ``(a * b).sum(-1)`` with ``b`` moved to ``a``'s device (``[batch, d]`` or broadcastable);
    ``keepdim``: ``[batch, 1]``."""
    return (a * on(b, a.device)).sum(-1, keepdim=keepdim)


def largest_abs(x: torch.Tensor) -> torch.Tensor:
    """``[]`` float32: ``max |x|`` over every element (its infinity norm: one op, where ``x.abs().max()`` is two;
    exact, as both are; a NaN anywhere gives NaN)."""
    return torch.linalg.vector_norm(x.float(), float("inf"))


def on(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``: ``t`` itself when it is there already (no op issued: each op the recipe issues in the
    forward pass is a kernel launch on a GPU, and costs microseconds on a CPU)."""
    return t if t.device == device else t.to(device)


CHUNK_ELEMENTS = 1 << 24  # float32 elements of a weight converted at once (64 MB): bounds memory in bf16 / fp16


def matmul_f32(x: torch.Tensor, weight: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``x @ weight`` (or ``x @ weight.T``) in float32, ``x`` ``[rows, k]`` float32, whatever ``weight``'s dtype.

    A float32 weight is used as is. A low-precision one (a bfloat16 model on NDIF) is converted a slice of rows at
    a time, so no float32 copy of a whole ``[d_mlp, d_model]`` matrix is ever held: the memory stays bounded and
    the products are accumulated in float32.
    """
    x = x.to(weight.device)
    with exact():
        if weight.dtype == torch.float32:
            return x @ weight.T if transpose else x @ weight
        step = max(1, CHUNK_ELEMENTS // weight.shape[1])
        if transpose:  # weight [n, k]: each slice of rows gives a slice of the output's columns
            return torch.cat([x @ weight[i:i + step].float().T for i in range(0, weight.shape[0], step)], -1)
        out = torch.zeros(x.shape[0], weight.shape[1], device=weight.device)
        for i in range(0, weight.shape[0], step):  # weight [k, n]: each slice of rows adds its share of the sum
            out += x[:, i:i + step] @ weight[i:i + step].float()
        return out


def linear_pullback(module, u: torch.Tensor, transposed: bool):
    """``(W^T u [batch, in_features], bias . u [batch] or 0.0)`` for an ``nn.Linear`` (or ``Conv1D`` if transposed).

    A grouped projection (``n_groups`` blocks on the diagonal, each ``[out / G, in]``) pulls each group's slice of
    ``u`` back through its own block: ``[batch, G * in]``.
    """
    weight = module.weight
    u = u.to(weight.device)
    bias = getattr(module, "bias", None)
    constant = dot(u, bias.float()) if bias is not None else 0.0
    groups = getattr(module._module, "n_groups", None) if hasattr(module, "_module") else None
    if groups:
        blocks = weight.view(groups, -1, weight.shape[-1])  # [G, out / G, in]
        parts = u.view(u.shape[0], groups, -1)
        return torch.cat([matmul_f32(parts[:, g], blocks[g]) for g in range(groups)], -1), constant
    return matmul_f32(u, weight, transpose=transposed), constant


def relative_gap(rebuilt: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[]`` float32 on ``rebuilt``'s device: ``max |rebuilt - real| / max |real|`` (0 when ``real`` is empty), how
    far a vector the recipe rebuilt is from the model's own. Not read on the host: a read would wait for the device.
    """
    if not real.numel():
        return torch.zeros((), device=rebuilt.device)
    real = real.to(rebuilt.device).float()
    return (rebuilt.float() - real).abs().max() / real.abs().max().clamp(min=1e-30)
