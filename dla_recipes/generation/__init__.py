"""``attribute_generation``: the model's own answer generated, then every generated token attributed at its
position, in ONE teacher-forced forward pass over prompt + answer.

    attr = dla_recipes.attribute_generation(model, [{"role": "user", "content": "Capital of France?"}],
                                            max_new_tokens=16, contrast="runner-up", by="head")
    attr.generation.texts[0]        # the answer
    attr.values                     # [batch, n_steps, n_components]: step k = the answer's k-th token
    attr.contrast_tokens            # what each step was contrasted with (its runner-up)

It is the existing verbs in sequence, no flag threaded through them: the generation (``generation.run``: nnsight's
``model.generate``, locally or on NDIF) gives each answer; ``attribute(model, prompt + answer, "next",
position=<each answer's own span>)`` attributes it, self-checked against that forward's own logits as every call
is; the result is that ``PositionAttribution`` with the answers (``GenerationAttribution``). The generation's
logits (KV cache, one token at a time) and the teacher-forced pass's differ by rounding: the per-step gap is kept
(``generation.gap``, ``diagnostics["generation_gap"]``); the parts sum to the teacher-forced logit, exactly as
``attribute`` promises, and a token is attributed as it was generated (sampled or not).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from ..api import Logits, attribute_logits, planned
from ..args import Check, Granularity
from ..errors import InputError
from ..present.positions import PositionAttribution
from ..question import Question, ask
from ..transport.batches import resolve_token
from .inputs import Settings, check_settings, prompt_ids, raise_all
from .result import Generation, GenerationAttribution
from .run import Generated, contrast_grid, forced
from .run import generate as run_generation
from .session import Asked, remote_generation

__all__ = ["Generation", "GenerationAttribution", "Settings", "attribute_generation"]

KEYWORDS = ("runner-up", "mean")


def attribute_generation(model, prompts, max_new_tokens: int = 32, *, generate: dict | None = None,
                         seed: int | None = None, contrast=None, position=None, by: Granularity = "block",
                         dictionaries: dict | None = None, sources: dict | None = None, intervene=None,
                         check: Check = "logit", tolerance: float | None = None, reduce=None, remote=False,
                         blocking: bool = True, batch_size: int | None = None, progress: bool | None = None,
                         fast=True):
    """Generate each prompt's answer and attribute every generated token's logit (minus ``contrast``) to the
    model's components, at the position that predicted it.

    Args:
        model: as in ``attribute`` (a ``StandardizedTransformer``; loaded for you from a folder or a short name).
        prompts: a string, a list of strings or token ids (as ``attribute``), or chat messages: one conversation (a
            list of ``{"role": ..., "content": ...}`` dicts) or a list of them, rendered by the tokenizer's chat
            template with ``add_generation_prompt=True``; only the generated (assistant) tokens are attributed.
        max_new_tokens: the most tokens generated a prompt; an EOS ends a row earlier (its later steps masked).
        generate: other transformers ``generate`` options (``do_sample``, ``temperature``, ``top_k``,
            ``eos_token_id``, ...), checked by transformers' ``GenerationConfig`` before anything runs.
        seed: the sampler's seed (``do_sample=True``); None draws one from torch's generator. It is recorded in
            ``generation.settings.seed``; a sampled token is attributed as sampled.
        contrast: ``None``; ``"runner-up"`` (at each step the most likely token other than the generated one, read
            from the generation's own logits, ties to the lowest id); ``"mean"``; a token (string or id) for every
            step; or one per step, a list per prompt (``[batch][>= A_b]`` tokens).
        position: not taken (refused with the fix named): each generated token is attributed at its own position.
        by, dictionaries, sources, check, tolerance, remote, batch_size, progress, fast: as in ``attribute`` (the
            generation runs in batches too; ``dictionaries``: which latents wrote each generated token).
        intervene: ``fn(model)`` as in ``attribute``, applied to the generation too: the answer is the EDITED
            model's, and its teacher-forced attribution is of the same edited forward pass. The edit runs at every
            generation step over the whole prefix (no KV cache) and each prompt runs alone (no padding), so an
            edit that indexes positions edits the same absolute positions at every step and in the teacher-forced
            pass (``batch_size`` is then 1).
        reduce: ``None``; ``"sum"`` (an answer's steps summed: one row a prompt); ``"stats"`` / ``Stats(...)``
            (statistics over every generated step of every prompt: an ``AttributionStats``, no answers kept).
        blocking: refused unless True: the answer must come back before its teacher-forced pass is built.

    Returns:
        A ``GenerationAttribution`` (``reduce="sum"``: an ``Attribution``, ``"stats"``: an ``AttributionStats``).
        Raises ``ExactnessError`` when the parts do not sum to the teacher-forced pass's own logit.
    """
    question = ask("attribute_generation", by=by, dictionaries=dictionaries, sources=sources, intervene=intervene,
                   check=check, tolerance=tolerance, reduce=reduce, remote=remote, blocking=blocking,
                   batch_size=batch_size, progress=progress, fast=fast)
    answer = Answer(max_new_tokens, generate, seed, contrast, position)
    return generation_logits(model, prompts, answer, question)


class Answer(NamedTuple):
    """What ``attribute_generation`` attributes: each prompt's generated answer (``max_new_tokens``, the
    ``generate`` options and ``seed``), each step minus ``contrast``; ``position`` (refused) as given."""

    max_new_tokens: object = 32
    generate: dict | None = None
    seed: object = None
    contrast: object = None
    position: object = None


def generation_logits(model, prompts, answer: Answer, question: Question):
    """``attribute_generation``'s work, from its checked ``question`` (``attribute_dataset(generate=...)`` calls
    it a chunk)."""
    q, contrast = question, answer.contrast
    if q.edits:  # each prompt alone: the edit indexes the same absolute positions in every pass
        q = q.but(batch_size=1)
    model, plan = planned(model, q)
    problems: list[str] = []
    ids, chat = prompt_ids(model.tokenizer, prompts, problems)
    config = getattr(getattr(model, "_module", None), "generation_config", None)
    settings = check_settings(config, answer.max_new_tokens, answer.generate, answer.seed, problems)
    chosen = contrast_ids(model, contrast, len(ids), answer.max_new_tokens, problems)
    if answer.position is not None:
        problems.append(f"position={answer.position!r}: attribute_generation attributes every generated token at "
                        "the position that predicted it; drop position= (other positions of prompt + answer: "
                        "attribute(model, prompt + answer ids, target, position=...))")
    raise_all(problems)
    asked = Asked(settings, chosen, contrast)
    if q.remote:  # the one session loop: generated and, unless by source or statistics, attributed in its sessions
        generated, attr = remote_generation(model, plan, ids, asked, q)
        check_given(contrast, chosen, generated)
        if attr is not None:
            return attr if not isinstance(attr, PositionAttribution) else with_generation(
                model, attr, generated, asked, chat)
    else:
        generated = run_generation(model, plan, ids, settings, chosen, q)
        check_given(contrast, chosen, generated)
    sequences, spans = forced(generated.prompts, generated.answers)
    grid = contrast_grid(contrast, generated.answers, generated.runner_up, chosen)
    attr = attribute_logits(model, sequences, Logits("next", grid, spans), q)
    if not isinstance(attr, PositionAttribution):
        return attr
    return with_generation(model, attr, generated, asked, chat)


def for_rows(generate: dict):
    """``attribute_dataset(..., generate=dict(max_new_tokens=8, ...))``'s call a chunk: ``(model, prompts,
    contrast, question)`` attributed as ``attribute_generation`` attributes them (the target is each answer)."""
    if not isinstance(generate, dict):
        raise InputError(f"generate={generate!r}: give a dict, e.g. dict(max_new_tokens=8, do_sample=False)")
    options = dict(generate)
    max_new_tokens = options.pop("max_new_tokens", 32)
    seed = options.pop("seed", None)

    def call(model, prompts, contrast, question):
        return generation_logits(model, prompts, Answer(max_new_tokens, options, seed, contrast), question)

    return call


def check_given(contrast, chosen, generated: Generated) -> None:
    """A contrast given per step must cover every step of each answer (known once it is generated)."""
    short = [f"prompt {i} (answer of {len(a)} tokens, contrast of {given_steps(contrast, i)})" for i, a in
             enumerate(generated.answers) if chosen is not None and given_steps(contrast, i) < len(a)]
    if short:
        raise_all([f"contrast gives fewer tokens than the answer has steps: {', '.join(short)}; give one per step"])


def given_steps(contrast, i: int) -> int:
    """How many steps of prompt ``i`` a per-step contrast covers (a keyword or one token: all)."""
    if isinstance(contrast, (list, tuple)):
        return len(contrast[i])
    return 1 << 30


def contrast_ids(model, contrast, n: int, width: int, problems: list[str]) -> list | None:
    """``[n][width]`` the token ids of a contrast given as a token or one per step (0-filled), or None for none /
    a keyword; bad tokens appended to ``problems``."""
    if contrast is None or isinstance(contrast, str) and contrast in KEYWORDS:
        return None
    width = width if isinstance(width, int) and width > 0 else 1
    if isinstance(contrast, (list, tuple)):
        if len(contrast) != n or not all(isinstance(row, (list, tuple)) for row in contrast):
            problems.append(f"contrast is a list of {len(contrast)}: give one list of tokens per prompt ({n}), one "
                            f"per generated step, or one token, or one of {KEYWORDS}")
            return None
        rows = contrast
    else:
        rows = [[contrast]] * n
    out = []
    for i, row in enumerate(rows):
        resolved = []
        for token in row[:width]:
            try:
                resolved.append(resolve_token(model, token, f"contrast of prompt {i}"))
            except InputError as error:
                problems.append(str(error))
                resolved.append(0)
        if not isinstance(contrast, (list, tuple)):
            resolved = resolved * width
        out.append(resolved + [0] * (width - len(resolved)))
    return out


def generation_value(contrast, generated: Generated, i: int) -> torch.Tensor:
    """``[A_i]``: the generation's own logit (difference) of prompt ``i``'s steps, as ``contrast`` attributes it."""
    own = generated.own[i]
    if contrast is None:
        return own
    if isinstance(contrast, str) and contrast == "runner-up":
        return own - generated.runner_up_logit[i]
    if isinstance(contrast, str) and contrast == "mean":
        return own - generated.mean[i]
    return own - generated.chosen[i]


def with_generation(model, attr: PositionAttribution, generated: Generated, asked: Asked,
                    chat: bool) -> GenerationAttribution:
    """``attr`` with the answers, and the gap of each step (generation minus teacher-forced) in its diagnostics;
    ``asked``: the generation's settings and contrast (as given, and its per-step ids)."""
    settings, contrast, chosen = asked.settings, asked.contrast, asked.chosen
    gap = torch.full(tuple(attr.index.shape), float("nan"))
    for i in range(len(attr)):
        steps = int(attr.mask[i].sum())
        gap[i, :steps] = generation_value(contrast, generated, i)[:steps] - attr.output_logit[i, :steps]
    sites = replace(attr.sites, diagnostics={**attr.sites.diagnostics, "generation_gap": gap[attr.mask]})
    if contrast is None or isinstance(contrast, str) and contrast == "mean":
        kind, per_step = contrast, None
    else:
        kind = "runner-up" if isinstance(contrast, str) else "given"
        rows = generated.runner_up if kind == "runner-up" else chosen
        per_step = tuple(tuple(r[:len(a)]) for r, a in zip(rows, generated.answers))
    record = Generation(generated.answers, tuple(model.tokenizer.decode(list(a)) for a in generated.answers),
                        tuple(len(p) for p in generated.prompts), kind, per_step, gap=gap, settings=settings,
                        chat=chat)
    return GenerationAttribution(sites, attr.index, attr.prompts, attr.tokens, generation=record)
