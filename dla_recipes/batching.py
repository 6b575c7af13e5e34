"""Which prompts share a forward pass: none is padded on a family whose outputs change with padding.

On most families left padding leaves a prompt's logits unchanged, so prompts are batched in the user's order,
``batch_size`` at a time. On a family with ``padding_safe=False`` (a recurrent state or a router that reads the pad
tokens: RecurrentGemma, DeepSeek-V4) a padded prompt would be attributed as the padded batch computes it, not as the
prompt alone; there prompts are grouped by token count, so no batch is padded, and the results are put back in the
user's order (``in_user_order``). Same-length prompts still share a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch


def group_prompts(lengths: Sequence[int], batch_size: int | None, padding_safe: bool) -> list[list[int]]:
    """The prompts' indices, one list per forward pass, at most ``batch_size`` each (None or 0: no limit).

    ``padding_safe``: consecutive prompts in the user's order. Otherwise: prompts of one token count per batch,
    groups in the order of their first prompt, prompts in the user's order inside each. Every index appears once.
    """
    n = len(lengths)
    size = n if not batch_size else max(1, int(batch_size))
    if padding_safe:
        groups = [list(range(n))]
    else:
        by_length: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            by_length.setdefault(int(length), []).append(i)
        groups = list(by_length.values())
    return [group[i:i + size] for group in groups for i in range(0, len(group), size)]


def token_lengths(model, prompts: Sequence[str]) -> list[int]:
    """Each prompt's own token count, as ``inputs.prepare`` tokenizes it (special tokens included)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        return [0] * len(prompts)  # prepare raises the clear error
    return [len(tokenizer(p)["input_ids"]) if isinstance(p, str) else 0 for p in prompts]


def in_user_order(attr, order: Sequence[int]):
    """``attr`` (rows in run order: row ``k`` is prompt ``order[k]``) with its rows back in the user's order."""
    order = list(order)
    if order == sorted(order):
        return attr
    index = torch.empty(len(order), dtype=torch.long)
    index[torch.as_tensor(order)] = torch.arange(len(order))  # index[prompt] = its row in run order

    def rows(value):
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == len(order):
            return value[index]
        if isinstance(value, tuple) and len(value) == len(order):
            return tuple(value[int(i)] for i in index)
        return value

    return replace(
        attr,
        values=rows(attr.values), constant=rows(attr.constant), logit=rows(attr.logit),
        output_logit=rows(attr.output_logit), prompts=rows(attr.prompts), target_tokens=rows(attr.target_tokens),
        contrast_tokens=rows(attr.contrast_tokens), positions=rows(attr.positions),
        diagnostics={key: rows(value) for key, value in attr.diagnostics.items()},
    )
