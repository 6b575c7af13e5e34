"""A word given without the leading space the model most likely predicts: attributed as given, with a warning.

``space_warning`` (called by ``batches.resolve_all`` for every call's target and contrast) warns when a token was
given as text starting with a letter whose spaced form is one other token of the vocabulary (``spaced_id``), after a
prompt that does not end in whitespace; ``warned`` counts the warnings, so that ``transport.memo`` keeps no call
that warned (asked again, it warns again).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

from .sites import remembered, which


def spaced_id(tokenizer, word: str) -> int | None:
    """The id of ``" " + word`` when that is a single token, else None (``word``: no leading space, a letter
    first)."""
    if not word or not word[0].isalpha():
        return None
    ids = remembered(tokenizer, ("ids", " " + word), lambda: list(tokenizer(" " + word, add_special_tokens=False)["input_ids"]))
    return int(ids[0]) if len(ids) == 1 else None


_warned = 0  # the warnings space_warning issued in this process (``warned``)


def warned() -> int:
    """How many warnings ``space_warning`` has issued in this process: a call whose preparation warned is not kept
    (``transport.memo``), so it warns again when asked again."""
    return _warned


def space_warning(model, prompts, tokens, ids, role: str, rows: Sequence[int]) -> None:
    """Warn when a word is given without its leading space (``"Paris"``) where the model most likely predicts
    the spaced token (``" Paris"``); the word is attributed as given.

    The rule reads only the tokenizer: it warns when the token was given as text starting with a letter, its
    spaced form is ONE other token of the vocabulary, and the prompt does not end in whitespace (after a space
    or a newline the unspaced token is the natural one). It does not read the model's logits: they are known only
    after the trace (remotely: after the request), and a second logit read for every call would cost each call
    for the sake of a few. On SmolLM2-135M and Gemma-3-270M the unspaced word's logit ("Paris", "Rome" after three
    city prompts) is 7 to 9.5 below the spaced one's: the unspaced word is almost never what was meant. A token id never
    warns: pass ``tokenizer.convert_tokens_to_ids(...)`` to attribute the unspaced token on purpose.
    """
    global _warned
    tokenizer = model.tokenizer
    found: dict[tuple[str, int, int], list[int]] = {}
    spaced: dict[str, int | None] = {}
    for i, prompt, token, index in zip(rows, prompts, tokens, ids):
        if isinstance(token, str) and not isinstance(prompt, str):  # token ids: the text they decode to
            prompt = tokenizer.decode([int(t) for t in prompt])
        if not isinstance(token, str) or not prompt or prompt[-1].isspace():
            continue
        if token not in spaced:
            spaced[token] = spaced_id(tokenizer, token)
        if spaced[token] is not None and spaced[token] != index:
            found.setdefault((token, index, spaced[token]), []).append(i)
    for (token, index, other), indices in found.items():
        _warned += 1
        where = which(indices, len(prompts)) + (" does" if len(indices) == 1 else " do")
        warnings.warn(
            f"{role} {token!r} has no leading space, but {' ' + token!r} is one token too (id {other}), the one a "
            f"model usually predicts after a word, and {where} not end in a space. "
            f"Attributing {token!r} (id {index}) as given: pass {' ' + token!r} for the spaced word, or the id "
            f"{index} to keep {token!r} without this warning",
            UserWarning, stacklevel=user_stacklevel(),
        )


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` (called by the caller of this function) that names the first frame
    outside dla_recipes: the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "dla_recipes":
        frame, level = frame.f_back, level + 1
    return level
