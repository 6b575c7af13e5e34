"""The two calls most users need: ``load`` a model as a StandardizedTransformer, and ``attribute`` a logit.

``attribute`` checks its input on the client, resolves the family table against the model (``plan.py``), runs the
in-trace recipe (``recipe.py``) locally or on an NDIF server, and returns an ``Attribution`` after checking that the
parts sum to the model's own logit; a family whose parts do not sum raises ``ExactnessError`` instead of returning
a wrong answer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Sequence

import nnsight
import torch

from . import _compat  # noqa: F401  (before nnterp)
from .attribution import Attribution
from .batching import group_prompts, in_user_order, token_lengths
from .check import check_exact, model_dtype, self_check  # noqa: F401  (check_exact: public, re-exported)
from .errors import DLAError, InputError, RemoteError
from .families import family_of
from .inputs import per_prompt, prepare
from .plan import Granularity, build_plan, check_granularity
from .recipe import Readout, direct_logit_attribution, direction_attribution


def _tokenizer_for(model, tokenizer):
    """The tokenizer object to hand nnsight: given, or loaded from ``tokenizer`` / the model's name or folder.

    nnsight 0.8.1 does not hand transformers 5's pipeline a tokenizer for a name or folder, so it is loaded here.
    """
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    source = tokenizer or (model if isinstance(model, str) else getattr(model.config, "name_or_path", None))
    if not source:
        raise ValueError("a model object needs a tokenizer: load(model, tokenizer=...)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as error:  # noqa: BLE001 - say what failed; nnsight would fail later and say less
        raise ValueError(f"could not load a tokenizer for {str(source)!r} ({error}); pass tokenizer=...") from error


def _family_kwargs(model) -> dict:
    """What the family table says nnterp needs to load this model (empty for an unknown or unreachable config)."""
    from nnterp.rename_utils import RenameConfig

    config = getattr(model, "config", None)
    if config is None:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)
        except Exception:  # noqa: BLE001 - an offline hub id: load without the family's hints
            return {}
    try:
        family = family_of(config)
    except ValueError:
        return {}
    kwargs = dict(family.load_kwargs)
    if family.rename:
        kwargs["rename_config"] = RenameConfig(**family.rename)
    return kwargs


def load(model, tokenizer=None, **kwargs):
    """Load ``model`` as an nnterp ``StandardizedTransformer`` with the nnsight 0.8 compatibility fix applied.

    Args:
        model: a hub id or local folder (str / path), an already-built transformers model, or a
            StandardizedTransformer (returned as is).
        tokenizer: a tokenizer object, or a hub id / folder to load one from; default: the model's own.
        **kwargs: passed to ``StandardizedTransformer`` (e.g. ``dtype``, ``device_map``, ``remote=True`` to build
            the model without weights for NDIF). The family table's loading needs (a ``RenameConfig`` for Phi,
            RecurrentGemma, Zamba2; ``allow_multimodal``; ``check_renaming``) are filled in unless given.
    """
    from nnterp import StandardizedTransformer

    if isinstance(model, StandardizedTransformer):
        return model
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    kwargs = {**_family_kwargs(model), **kwargs, "tokenizer": _tokenizer_for(model, tokenizer)}
    # nnterp checks its renaming with a fake-tensor scan; on fused MoE experts torch logs a long, harmless error
    # traceback before nnterp falls back to a real trace. Keep it out of the user's output.
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.CRITICAL)
    try:
        return StandardizedTransformer(model, **kwargs)
    finally:
        fake_tensor_log.setLevel(level)


def _register_for_remote() -> None:
    """Ship dla_recipes by value: an NDIF server has nnsight and torch, not this package."""
    import dla_recipes

    nnsight.register(dla_recipes)


def _remote_host(remote) -> str:
    return remote if isinstance(remote, str) else str(nnsight.CONFIG.API.HOST)


def remote_error(error: BaseException, remote) -> RemoteError:
    """A ``RemoteError`` naming the cause of a failed remote run: key, host, model, or the server-side exception."""
    host = _remote_host(remote)
    text = str(error).strip() or type(error).__name__
    if isinstance(error, (ConnectionError, TimeoutError)) or "Connection refused" in text:
        return RemoteError(f"cannot reach the NDIF server at {host}: {text}. Is the host right and the server up?")
    if "API key" in text or "api key" in text.lower():
        return RemoteError(
            f"the NDIF server at {host} refused the API key: {text}. Set NDIF_API_KEY (or nnsight.CONFIG.API.APIKEY)."
        )
    if "not hosted" in text or "not running" in text or "not deployed" in text:
        return RemoteError(f"the NDIF server at {host} does not host this model: {text}")
    cause = [line for line in text.splitlines() if line.strip()][-1].strip()
    return RemoteError(f"the remote trace failed on the NDIF server at {host}: {cause}\n\nServer traceback:\n{text}")


def run_trace(model, plan, batch, recipe, args: tuple, remote=False) -> Readout:
    """One trace of ``batch`` running ``recipe(model, *args)`` (an in-trace function returning a ``Readout``).

    The head runs on the last positions the batch attributes only (transformers' ``logits_to_keep``), where the
    family allows it: every prompt's last token with left padding and ``position=-1``.

    ``remote``: False, True (NDIF) or a server URL. Remotely the recipe runs server side and one
    ``[batch, n_components + 6]`` tensor comes back.
    """
    trace_kwargs = {}
    if remote:
        _register_for_remote()
        trace_kwargs["remote"] = remote
    if plan.family.logits_to_keep and _keeps_logits(model):  # only the attributed positions need logits
        trace_kwargs["logits_to_keep"] = int(batch.encoding["input_ids"].shape[1] - batch.positions.min())
    try:
        with torch.no_grad(), model.trace(dict(batch.encoding), **trace_kwargs):
            packed = recipe(model, *args).pack()
            packed = nnsight.save(packed)
    except Exception as error:
        if not remote or isinstance(error, DLAError):
            raise
        raise remote_error(error, remote) from error
    return Readout.unpack(packed)


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers computes the head on those positions only)."""
    import inspect

    return "logits_to_keep" in inspect.signature(model._module.forward).parameters


def _groups(model, plan, prompts: list, batch_size: int | None) -> list[list[int]]:
    """The prompts' indices per forward pass (``batching.py``): never a padded batch on a padding-unsafe family."""
    safe = plan.family.padding_safe
    lengths = [0] * len(prompts) if safe else token_lengths(model, prompts)
    return group_prompts(lengths, batch_size, safe)


def _prompts(prompts) -> list[str]:
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise InputError("no prompts given: pass a string or a non-empty list of strings")
    return prompts


def _run_batches(model, plan, batches, recipe, make_args, by, remote, progress, tolerance, stop=None) -> Attribution:
    """Run ``recipe`` on each batch (one trace / request each), concatenate, self-check, label."""
    show = progress if progress is not None else len(batches) > 1
    if show:
        from tqdm.auto import tqdm

        batches_iter = tqdm(batches, desc=f"DLA by {by}", unit="batch")
    else:
        batches_iter = batches
    readouts = [run_trace(model, plan, batch, recipe, make_args(batch), remote) for batch in batches_iter]
    readout = Readout(
        **{name: torch.cat([getattr(r, name) for r in readouts]).float()
           for name in ("values", "constant", "logit", "output_logit", "scale") + Readout._SCALARS[6:]},
        head_error=torch.stack([r.head_error for r in readouts]).max(),
        norm_fit_error=torch.stack([r.norm_fit_error for r in readouts]).max(),
    )
    error, checked = self_check(readout, plan, by, model_dtype(model), tolerance, labels=plan.labels(by, stop))
    contrast_tokens = [b.contrast_tokens for b in batches]
    return Attribution(
        values=readout.values,
        labels=plan.labels(by, stop),
        constant=readout.constant,
        logit=readout.logit,
        output_logit=readout.output_logit,
        error=error,
        prompts=sum((b.prompts for b in batches), ()),
        target_tokens=sum((b.target_tokens for b in batches), ()),
        contrast_tokens=None if contrast_tokens[0] is None else sum(contrast_tokens, ()),
        positions=sum((b.own_positions for b in batches), ()),
        by=by,
        family=plan.family.name,
        diagnostics={
            "norm_fit_error": float(readout.norm_fit_error),
            "head_error": float(readout.head_error),
            "scale": readout.scale,
            **checked,
        },
    )


def attribute(
    model,
    prompts: str | Sequence[str],
    target,
    *,
    contrast=None,
    position: int = -1,
    by: Granularity = "block",
    remote=False,
    batch_size: int | None = None,
    progress: bool | None = None,
    tolerance: float | None = None,
) -> Attribution:
    """Attribute the logit of ``target`` (minus ``contrast``) at ``position`` to the model's components.

    Args:
        model: a ``StandardizedTransformer`` (``dla_recipes.load``).
        prompts: a string or a list of strings (a batch, padded as nnsight pads).
        target, contrast: a token string (``" Paris"``) or id; one for all prompts or one per prompt.
        position: the attributed position; negative counts from the end of each prompt's own tokens, so padding
            never shifts it.
        by: ``"block"`` (embed, then each block's terms), ``"head"``, ``"neuron"`` (MLP neurons, and the neurons
            of every routed expert) or ``"expert"`` (one component per routed expert).
        remote: ``True`` to run on NDIF (host from nnsight's config / ``NDIF_HOST``, key from ``NDIF_API_KEY``),
            or a server URL such as ``"http://127.0.0.1:PORT"``. The math runs server side; only the result returns.
        batch_size: prompts per forward pass (one trace, one remote request each); default: all in one.
        progress: show a progress bar over the batches (default: when there is more than one).
        tolerance: relative tolerance of the self-check (default by dtype: 1e-4 in float32).

    Returns:
        An ``Attribution``: ``values [batch, n_components]``, ``labels``, ``constant [batch]``, ``logit [batch]``,
        ``error``. Raises ``ExactnessError`` when the parts do not sum to the model's own logit.
    """
    check_granularity(by)
    prompts = _prompts(prompts)
    plan = build_plan(model)
    targets = per_prompt(target, len(prompts), "target")
    contrasts = None if contrast is None else per_prompt(contrast, len(prompts), "contrast")
    groups = _groups(model, plan, prompts, batch_size)
    batches = [
        prepare(model, [prompts[i] for i in g], [targets[i] for i in g],
                None if contrasts is None else [contrasts[i] for i in g], position)
        for g in groups
    ]
    attr = _run_batches(
        model, plan, batches, direct_logit_attribution,
        lambda b: (plan, b.positions, b.targets, b.contrasts, by), by, remote, progress, tolerance,
    )
    return in_user_order(attr, [i for g in groups for i in g])


def attribute_direction(
    model,
    prompts: str | Sequence[str],
    direction: torch.Tensor,
    *,
    layer: int,
    sublayer: str = "mlp",
    position: int = -1,
    by: Granularity = "block",
    remote=False,
    batch_size: int | None = None,
    progress: bool | None = None,
    tolerance: float | None = None,
) -> Attribution:
    """Attribute ``norm(stream) @ direction`` where ``norm`` is the norm in front of block ``layer``'s ``sublayer``.

    The stream that sublayer reads is decomposed into the terms written before it (the embedding, every earlier
    block's terms, and this block's earlier terms unless the block is parallel), the norm that really reads it is
    frozen at that stream, and the parts sum to the model's own ``norm(stream) @ direction``, read from the norm's
    output in the same trace. Every row is read through that one norm's frozen scale.

    Args:
        direction: ``[d_model]`` or ``[batch, d_model]``: a direction on the norm's output (a probe, a query
            direction, a difference of means).
        layer, sublayer: the block and its sublayer (``"attn"``, ``"mlp"``, ...; names as in the labels) whose
            norm reads the stream: ``sublayer="mlp"`` is ``ln2`` / ``post_attention_layernorm``.
        position, by, remote, batch_size, progress, tolerance: as in ``attribute``.

    Returns:
        An ``Attribution`` whose ``logit`` is ``norm(stream) @ direction`` at each prompt's position.
    """
    check_granularity(by)
    prompts = _prompts(prompts)
    plan = build_plan(model)
    stop = plan.stop_before(layer, sublayer)
    reads = plan.layers[stop[0]][[p.term.name for p in plan.layers[stop[0]]].index(sublayer)].term.reads
    direction = torch.as_tensor(direction)
    if direction.device.type == "meta":
        raise InputError(
            "direction is on the meta device: a model's weights load at its first trace, so build the direction "
            "after one (or load with dispatch=True), or pass a real tensor"
        )
    direction = direction.detach().float().cpu()
    width = int(model.lm_head.weight.shape[-1])
    if direction.shape[-1] != width or direction.dim() not in (1, 2):
        raise InputError(f"direction has shape {tuple(direction.shape)}: give [d_model={width}] or [batch, {width}]")
    if direction.dim() == 2 and direction.shape[0] != len(prompts):
        raise InputError(f"{direction.shape[0]} directions for {len(prompts)} prompts: give one or one per prompt")
    directions = direction.expand(len(prompts), -1)
    groups = _groups(model, plan, prompts, batch_size)
    batches = [prepare(model, [prompts[i] for i in g], 0, None, position) for g in groups]
    group_of = {id(b): torch.as_tensor(g) for b, g in zip(batches, groups)}
    attr = _run_batches(
        model, plan, batches, direction_attribution,
        lambda b: (plan, b.positions, directions[group_of[id(b)]], stop, reads, by), by, remote, progress, tolerance,
        stop=stop,
    )
    attr = in_user_order(attr, [i for g in groups for i in g])
    return replace(attr, target_tokens=(), read_by=f"L{stop[0]}.{reads}")
