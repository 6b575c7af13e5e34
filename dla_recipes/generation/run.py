"""The model's own generation: nnsight's ``model.generate`` over left-padded prompts (remotely through the session
loop, ``generation.session``), each step's raw logits reduced in the trace to a few numbers a step (so a remote
answer returns ``[batch, steps]`` tensors, never ``[batch, steps, vocab]``).

Per generated step ``k`` of row ``b`` (the generation's OWN pass: the KV-cached decoding forward that chose the
token, its logits before any sampling processor) the trace returns: the token; its logit; the runner-up, the
most likely OTHER token (``argmax`` of the logits with the chosen token set to ``-inf``: for a greedy answer the
second most likely token, for a sampled one the best token not drawn; ties go to the lowest id, as ``torch.max``
breaks them) and its logit; the mean logit; and the logit of a contrast given per step. An EOS ends a row: its
answer is the tokens through the first EOS (``Generated.answers``), what transformers writes after it is dropped.
A family whose padding changes a prompt's logits generates its prompts grouped by length (``transport.batches``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import nnsight
import torch

from ..transport.batches import groups
from .inputs import Settings


@dataclass(frozen=True)
class Generated:
    """The answers, one row a prompt (the user's order).

    Attributes:
        prompts: each prompt's own ids ``[n][P_b]``.  answers: each answer's ids ``[n][A_b]``, through its EOS.
        own, runner_up_logit, mean, chosen: ``[n][A_b]`` float32 from the generation's own pass: the generated
            token's logit, the runner-up's, the mean logit over the vocabulary, the per-step contrast's (0 without).
        runner_up: ``[n][A_b]`` the runner-up token ids.
    """

    prompts: tuple
    answers: tuple
    own: tuple
    runner_up: tuple
    runner_up_logit: tuple
    mean: tuple
    chosen: tuple


def step_readout(result, width: int, chosen: torch.Tensor) -> tuple:
    """In the trace: ``generate``'s output (``sequences [batch, width + steps]``, ``logits``: ``steps`` x ``[batch,
    vocab]``) as ``(tokens, own, runner_up, runner_up_logit, mean, chosen_logit)``, each ``[batch, steps]``;
    ``chosen``: ``[batch, >= steps]`` per-step contrast ids."""
    logits = torch.stack(tuple(result.logits), 1).float()  # [batch, steps, vocab]
    steps = logits.shape[1]
    tokens = result.sequences[:, width:width + steps].to(logits.device)
    own = logits.gather(-1, tokens[..., None])[..., 0]
    rest = logits.scatter(-1, tokens[..., None], float("-inf"))
    runner_logit, runner = rest.max(-1)  # the first maximal index on ties
    picked = logits.gather(-1, chosen[:, :steps].to(logits.device)[..., None])[..., 0]
    return tuple(t.cpu() for t in (tokens, own, runner, runner_logit, logits.mean(-1), picked))


def left_padded(rows: list, pad: int) -> dict:
    """``{"input_ids", "attention_mask"}`` ``[batch, width]``, the rows padded on the left (generation appends)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask}


def generate_group(model, encoding: dict, settings: Settings, chosen: torch.Tensor, intervene=None) -> tuple:
    """One local ``model.generate`` trace of a padded group; ``step_readout``'s tensors (a remote generation runs in
    the session loop: ``generation.session``).

    ``intervene``: the edit runs at every step (``tracer.all()``), each step a forward pass over the whole prefix
    (``use_cache=False``), so an edit that indexes positions edits the same ones at every step."""
    kwargs = settings.kwargs(edited=intervene is not None)
    width = int(encoding["input_ids"].shape[1])
    with torch.random.fork_rng(devices=_devices(model)):
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        if intervene is None:
            with torch.no_grad(), model.generate(dict(encoding), **kwargs) as tracer:
                out = nnsight.save(step_readout(tracer.result, width, chosen))
        else:  # nnsight warns that the open loop ended with the generation: that is the loop's end by design
            with warnings.catch_warnings(), torch.no_grad(), model.generate(**kwargs) as tracer:
                warnings.filterwarnings("ignore", message=".*was never reached.*", category=UserWarning)
                with tracer.invoke(dict(encoding)):
                    for _ in tracer.all():  # the edit at every step of the generation
                        intervene(model)
                with tracer.invoke():
                    out = nnsight.save(step_readout(tracer.result, width, chosen))
    return out


def _devices(model) -> list:
    """The CUDA devices whose generator a local sampled run forks and seeds (none on CPU)."""
    device = getattr(getattr(getattr(model, "_module", None), "lm_head", None), "weight", None)
    device = getattr(device, "device", None)
    return [device] if getattr(device, "type", "") == "cuda" else []


def eos_ids(model, settings: Settings) -> set[int]:
    """The token ids that end an answer: ``eos_token_id`` of the options, else of the model's generation config."""
    eos = dict(settings.options).get("eos_token_id")
    if eos is None:
        config = getattr(getattr(model, "_module", None), "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def pad_id(model, settings: Settings) -> int:
    """The id the prompts are left-padded with: the tokenizer's pad token, else an EOS (masked either way)."""
    pad = model.tokenizer.pad_token_id
    return pad if pad is not None else next(iter(sorted(eos_ids(model, settings))), 0)


def generate(model, plan, prompts: list, settings: Settings, chosen: list | None, question=None) -> Generated:
    """The answers of ``prompts`` (own ids ``[n][P_b]``), generated locally; ``chosen``: per-step contrast ids
    ``[n][max_new_tokens]`` (None: no such contrast); ``question``: the call's ``Question`` (its ``batch_size``
    and ``intervene``; None: all in one batch, unedited)."""
    batch_size, intervene = (None, None) if question is None else (question.batch_size, question.intervene)
    stop, pad = eos_ids(model, settings), pad_id(model, settings)
    rows: list = [None] * len(prompts)
    for group in groups(model, plan, prompts, batch_size, [list(p) for p in prompts]):
        encoding = left_padded([prompts[i] for i in group], pad)
        out = generate_group(model, encoding, settings, chosen_ids(chosen, group, settings.max_new_tokens),
                             intervene)
        for k, i in enumerate(group):
            rows[i] = row_of(out, k, stop)
    return collect(prompts, rows)


def chosen_ids(chosen: list | None, group, width: int) -> torch.Tensor:
    """``[len(group), width]`` the group's per-step contrast ids (zeros without)."""
    if chosen is None:
        return torch.zeros(len(group), width, dtype=torch.long)
    return torch.tensor([chosen[i] for i in group], dtype=torch.long)


def row_of(out: tuple, k: int, stop: set[int]) -> tuple:
    """Row ``k`` of ``step_readout``'s tensors, cut after its first EOS (``stop``): ``(answer ids, *[A] tensors)``."""
    tokens = out[0][k].tolist()
    end = next((j + 1 for j, t in enumerate(tokens) if t in stop), len(tokens))
    return (tuple(tokens[:end]), *(t[k, :end].float() for t in out[1:]))


def collect(prompts, rows: list) -> Generated:
    """The ``Generated`` record of every prompt's ``row_of``."""
    return Generated(prompts=tuple(tuple(p) for p in prompts), answers=tuple(r[0] for r in rows),
                     own=tuple(r[1] for r in rows), runner_up=tuple(tuple(int(t) for t in r[2]) for r in rows),
                     runner_up_logit=tuple(r[3] for r in rows), mean=tuple(r[4] for r in rows),
                     chosen=tuple(r[5] for r in rows))


def forced(prompts, answers) -> tuple[list, tuple]:
    """The teacher-forced pass's inputs: each prompt + its answer (own ids), and the span of positions that
    predicted the answer's tokens (``slice(P_b - 1, P_b - 1 + A_b)``: ``attribute``'s ``position``, one a prompt)."""
    sequences = [list(p) + list(a) for p, a in zip(prompts, answers)]
    return sequences, tuple(slice(len(p) - 1, len(p) - 1 + len(a)) for p, a in zip(prompts, answers))


def contrast_grid(contrast, answers, runner_up, chosen):
    """The ``contrast`` ``attribute`` gets: None, ``"mean"``, or ``[n][n_steps]`` ids (each step's runner-up, or
    the contrast given per step: ``chosen`` rows), 0-filled past a row's answer (masked sites read none)."""
    if contrast is None or isinstance(contrast, str) and contrast == "mean":
        return contrast
    width = max(len(a) for a in answers)
    rows = runner_up if isinstance(contrast, str) else [c[:len(a)] for c, a in zip(chosen, answers)]
    return [list(r)[:len(a)] + [0] * (width - min(len(a), len(r))) for r, a in zip(rows, answers)]
