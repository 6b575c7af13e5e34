"""``GenerationAttribution``: a ``PositionAttribution`` over the generated steps, with the answer that was generated.

Column ``k`` of the table is generation step ``k``: the site is the position that predicted the answer's ``k``-th
token (prompt length - 1 + k in the teacher-forced sequence prompt + answer), its target that token, masked after a
row's EOS. ``generation`` holds the answers (ids, text), how they were generated (``Settings``: the seed of a
sampled answer), what each step was contrasted with, and the per-step gap between the generation's own logit and
the teacher-forced one (also ``diagnostics["generation_gap"]``, ``[batch, n_steps]``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..present.attribution import row_index
from ..present.positions import PositionAttribution
from .inputs import Settings


@dataclass(frozen=True)
class Generation:
    """What was generated, and how it relates to the attribution.

    Attributes:
        answers: each prompt's generated ids ``[batch][A_b]`` (through its EOS).  texts: each answer decoded.
        prompt_lengths: each prompt's own token count (the answer starts there in the teacher-forced sequence).
        contrast: ``None``, ``"runner-up"``, ``"mean"``, or ``"given"`` (a token, or one per step).
        contrast_ids: ``[batch][A_b]`` the token each step was contrasted with (None: no token contrast).
        gap: ``[batch, n_steps]`` float32: the generation's own logit (difference) of each step minus the
            teacher-forced one the parts sum to (``output_logit``), NaN where masked.
        settings: max_new_tokens, the generate options, the seed (sampled answers).
        chat: the prompts were chat messages (rendered by the tokenizer's chat template).
    """

    answers: tuple
    texts: tuple
    prompt_lengths: tuple
    contrast: str | None
    contrast_ids: tuple | None
    gap: torch.Tensor
    settings: Settings
    chat: bool = False

    def select(self, rows: list[int]) -> Generation:
        """The record of the prompts ``rows`` (in that order)."""
        pick = lambda values: None if values is None else tuple(values[i] for i in rows)
        return replace(self, answers=pick(self.answers), texts=pick(self.texts),
                       prompt_lengths=pick(self.prompt_lengths), contrast_ids=pick(self.contrast_ids),
                       gap=self.gap[torch.as_tensor(rows, dtype=torch.long)])

    @property
    def max_gap(self) -> float:
        """The largest ``|gap|`` over the generated steps."""
        gap = self.gap[~torch.isnan(self.gap)]
        return float(gap.abs().max()) if gap.numel() else 0.0


@dataclass(eq=False)
class GenerationAttribution(PositionAttribution):
    """``PositionAttribution`` over the generated steps (``values [batch, n_steps, n_components]``), plus
    ``generation``; selecting prompts (``attr[i]``, ``attr[[0, 2]]``, a mask) keeps their answers."""

    generation: Generation | None = None

    def __getitem__(self, rows) -> GenerationAttribution:
        picked = super().__getitem__(rows)
        chosen = row_index(rows, len(self))
        return GenerationAttribution(picked.sites, picked.index, picked.prompts, picked.tokens,
                                     generation=None if self.generation is None else self.generation.select(chosen))

    def __repr__(self) -> str:
        text = super().__repr__().replace("PositionAttribution(", "GenerationAttribution(", 1)
        if self.generation is None:
            return text
        return (f"{text[:-1]}, answers {[t[:30] for t in self.generation.texts[:2]]}"
                f"{'...' if len(self) > 2 else ''}, generation gap {self.generation.max_gap:.2e})")
