"""Planted writes for the tests and benchmarks that check a write no component made is caught: ``adding(vector)``,
a torch forward hook that adds a vector to a module's output (``tests/test_add_check.py``,
``benchmarks/hidden_writes.py``)."""

from __future__ import annotations

import torch


def adding(vector: torch.Tensor):
    """A forward hook adding ``vector`` ``[d_model]`` to a module's output (a tensor, or a tuple's first element),
    in the output's dtype: ``module.register_forward_hook(adding(v))``."""
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + vector.to(output[0].dtype),) + tuple(output[1:])
        return output + vector.to(output.dtype)
    return hook
