"""``dla_recipes.testing.launches``: what it counts as a host sync on the CPU, where every tensor is a host tensor.

A sync is a read of a tensor derived from the model's parameters; a ``.cpu()`` copy of one is a host tensor a GPU
would read for free. On the CPU ``.cpu()`` returns the tensor itself, so the counter must not let the copy keep the
device tag (it did: every later ``float`` / ``bool`` / mask index of the copy counted as one more sync).
"""

from __future__ import annotations

import torch

from dla_recipes.testing.launches import Launches


def test_host_copy_is_free_to_read():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad(), Launches(model) as launches:
        device = model(torch.randn(2, 4))
        host = device.cpu()
        float(host[0, 0])
        bool((host > 0).any())
        host[host > 0].sum()
        float(device.sum())  # a read of the device tensor itself: a sync
    calls = [sync[2] for sync in launches.counts.syncs]
    assert calls == ["cpu", "__float__"], launches.counts.syncs
    assert launches.counts.ops["model"] > 0 and not launches.counts.widenings
