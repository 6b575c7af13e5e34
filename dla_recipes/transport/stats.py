"""``reduce="stats"``'s batches: pairs kept in one batch, each site's sample index, each batch's ``StatsCall``.

A sample is named by ``(start + the prompt's index) * 2**32 + its position column`` (``SAMPLE_STRIDE``), so the
random weights it draws (``math.stats``) do not depend on how the prompts were batched, nor on where they ran.
Paired (``Stats(paired=True)``): the prompts are ``clean + corrupted``, prompt ``i`` pairs with ``i + n/2``; both
run in one batch, and each clean site pairs with its twin's site in the same column (a site whose twin has no
site there, ``position="all"`` over prompts of different lengths, is left out).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from ..trace.stats import StatsCall
from .batches import group_prompts, token_ids

SAMPLE_STRIDE = 2**32


def pair_groups(model, plan, prompts: list, batch_size: int | None, ids=None) -> list[list[int]]:
    """The prompts' indices per forward pass with each pair ``(i, i + n/2)`` in one: ``batch_size`` counts prompts
    (two a pair). On a padding-unsafe family the two prompts of a pair must have one token count (``ids``: each
    prompt's token ids, ``batches.token_ids``, tokenized here when not given)."""
    n = len(prompts)
    if n % 2:
        raise InputError(f"Stats(paired=True) takes clean + corrupted prompts, two halves of one length: got {n}")
    half = n // 2
    safe = plan.family.padding_safe
    ids = None if safe else token_ids(model, plan, prompts) if ids is None else ids
    lengths = [0] * n if ids is None else [len(i) for i in ids]
    if not safe:
        differ = [i for i in range(half) if lengths[i] != lengths[i + half]]
        if differ:
            raise InputError(
                f"family {plan.family.name!r} cannot pad a batch, and the pairs {differ[:5]} have prompts of "
                f"different token counts ({lengths[differ[0]]} vs {lengths[differ[0] + half]}): a pair runs in one "
                "batch, so give pairs of equal length on this family")
    size = None if not batch_size else max(1, int(batch_size) // 2)
    return [g + [i + half for i in g] for g in group_prompts(lengths[:half], size, safe)]


def site_pairs(batch, group: Sequence[int], half: int) -> torch.Tensor:
    """``[m, 2]`` long: each clean site of ``batch`` (its prompts ``group``, as the user numbers them) and its
    corrupted twin's site in the same column."""
    rows = batch.rows.tolist()
    columns = list(batch.columns) or [0] * len(rows)
    where = {(group[r], c): s for s, (r, c) in enumerate(zip(rows, columns))}
    pairs = [(s, where[(group[r] + half, c)]) for s, (r, c) in enumerate(zip(rows, columns))
             if group[r] < half and (group[r] + half, c) in where]
    if not pairs:
        raise InputError(f"no site of prompts {list(group)[:4]}... has a twin in the same position column")
    return torch.tensor(pairs, dtype=torch.long)


def sample_index(batch, group: Sequence[int], start: int) -> torch.Tensor:
    """``[n]`` int64: each site's sample, ``(start + prompt) * SAMPLE_STRIDE + column``."""
    prompts = torch.tensor([start + group[int(r)] for r in batch.rows], dtype=torch.int64)
    columns = torch.tensor(list(batch.columns) or [0] * len(batch.rows), dtype=torch.int64)
    return prompts * SAMPLE_STRIDE + columns


def stats_calls(calls: Sequence, batches: Sequence, run_groups: Sequence, stats, tolerance: float | None,
                n_prompts: int) -> tuple:
    """Each batch's call wrapped in a ``StatsCall`` (``stats``: the ``Stats`` record's replicates, seed, paired,
    start and keep)."""
    half = n_prompts // 2
    return tuple(
        StatsCall(call, sample_index(batch, group, stats.start), stats.seed, stats.replicates, keep=stats.keep,
                  tolerance=tolerance, pairs=site_pairs(batch, group, half) if stats.paired else None)
        for call, batch, group in zip(calls, batches, run_groups))
