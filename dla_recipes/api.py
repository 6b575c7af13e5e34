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
from .errors import DLAError, ExactnessError, InputError
from .families import family_of
from .inputs import (
    check_arguments, check_device_map, check_dtype, check_int, check_prompts, check_source, per_prompt, prepare,
)
from .loading.load_errors import load_error
from .plan import Granularity, build_plan
from .recipe import Readout, direct_logit_attribution, direction_attribution
from .remote import RemoteBatchError, register_for_remote, retry_or_raise, run_all


def _tokenizer_for(model, tokenizer):
    """The tokenizer object to hand nnsight: given, or loaded from ``tokenizer`` / the model's name or folder.

    nnsight 0.8.1 does not hand transformers 5's pipeline a tokenizer for a name or folder, so it is loaded here.
    """
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    source = tokenizer or (model if isinstance(model, str) else getattr(model.config, "name_or_path", None))
    if not source:
        raise InputError(
            f"the {type(model).__name__} has no tokenizer name or folder: load(model, tokenizer=...) with a "
            "tokenizer object or folder"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as error:  # noqa: BLE001 - say what failed; nnsight would fail later and say less
        raise InputError(f"could not load a tokenizer for {str(source)!r} ({error}); pass tokenizer=...") from error


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
        model: a hub id or local folder (str / path), a short name of ``dla_recipes.models`` (``"smollm2"``,
            ``"gemma3"``), an already-built transformers model, or a StandardizedTransformer (returned as is).
            A missing folder, or a hub id while the hub is offline or unreachable, is an ``InputError`` at once.
        tokenizer: a tokenizer object, or a hub id / folder to load one from; default: the model's own.
        **kwargs: passed to ``StandardizedTransformer`` (e.g. ``dtype``, ``device_map``, ``remote=True`` to build
            the model without weights for NDIF; ``attn_implementation="eager"`` for ``by="source"``, also on an
            already-built model). The family table's loading needs (a ``RenameConfig`` for Phi,
            RecurrentGemma, Zamba2; ``allow_multimodal``; ``check_renaming``) are filled in unless given.
    """
    from nnterp import StandardizedTransformer

    if isinstance(model, StandardizedTransformer):
        return model
    check_device_map(kwargs.get("device_map"))
    if "dtype" in kwargs:
        kwargs["dtype"] = check_dtype(kwargs["dtype"])
    if isinstance(model, (str, os.PathLike)):
        model = check_source(model)
    if isinstance(model, torch.nn.Module) and "attn_implementation" in kwargs:  # a built model: switch it now
        model.set_attn_implementation(kwargs.pop("attn_implementation"))
    kwargs = {**_family_kwargs(model), **kwargs, "tokenizer": _tokenizer_for(model, tokenizer)}
    # nnterp checks its renaming with a fake-tensor scan; on fused MoE experts torch logs a long, harmless error
    # traceback before nnterp falls back to a real trace. Keep it out of the user's output.
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.CRITICAL)
    try:
        return StandardizedTransformer(model, **kwargs)
    except DLAError:
        raise
    except OSError as error:  # a hub id the hub does not have, a folder without weights
        if not isinstance(model, str):
            raise load_error(model, error) from error
        raise InputError(f"could not load model {model!r}: {error}") from error
    except Exception as error:  # noqa: BLE001 - nnterp's own errors name too little: say what it could not find
        raise load_error(model, error) from error
    finally:
        fake_tensor_log.setLevel(level)


def run_trace(model, plan, batch, recipe, args: tuple, remote=False, intervene=None) -> Readout:
    """One trace of ``batch`` running ``recipe(model, *args)`` (an in-trace function returning a ``Readout``).

    The head runs on the last positions the batch attributes only (transformers' ``logits_to_keep``), where the
    family allows it: every prompt's last token with left padding and ``position=-1``.

    ``remote``: False, True (NDIF) or a server URL. Remotely the recipe runs server side and one
    ``[batch, n_components + 6]`` tensor comes back; a transient failure (server unreachable, HTTP 5xx) is retried
    ``remote.RETRIES`` times, anything else raises a ``RemoteError`` naming its cause.

    ``intervene``: ``fn(model)``, nnsight code editing the forward pass (see ``attribute``). It runs in the invoke
    that carries the batch and the recipe in a second, empty invoke over the same rows: an invoke reads modules in
    forward order, so the recipe (which reads every block from the first) cannot share one with an edit at a later
    block, and the edits of the first invoke are made before the second reads the same site.
    """
    trace_kwargs = {}
    if remote:
        register_for_remote()
        trace_kwargs["remote"] = remote
    if plan.family.logits_to_keep and _keeps_logits(model):  # only the attributed positions need logits
        trace_kwargs["logits_to_keep"] = int(batch.encoding["input_ids"].shape[1] - batch.positions.min())
    attempt = 0
    while True:  # a transient remote failure is retried a bounded number of times (remote.py)
        try:
            if intervene is None:
                with torch.no_grad(), model.trace(dict(batch.encoding), **trace_kwargs):
                    packed = recipe(model, *args).pack()
                    packed = nnsight.save(packed)
            else:
                with torch.no_grad(), model.trace(**trace_kwargs) as tracer:
                    with tracer.invoke(dict(batch.encoding)):
                        intervene(model)
                    with tracer.invoke():
                        packed = recipe(model, *args).pack()
                        packed = nnsight.save(packed)
            break
        except Exception as error:
            if not remote:
                raise
            attempt = retry_or_raise(error, attempt, remote)
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
    return check_prompts(prompts)


def _run_batches(model, plan, batches, recipe, make_args, by, remote, progress, tolerance, stop=None,
                 done: tuple = (), intervene=None, sources=None, order=None) -> Attribution:
    """Run ``recipe`` on each batch (one trace / request each), concatenate, self-check, label.

    ``done``: readouts of the first batches, already run (``RemoteBatchError.resume``). When remote request ``k``
    fails for good, a ``RemoteBatchError`` keeps the attribution of the requests that completed and can resume.
    ``sources``: the ``plan.Sources`` of a ``by="source"`` run (its labels). ``order``: the user's index of each
    prompt in run order (``batching.group_prompts``); the result's rows are put back in the user's order.
    """
    todo = batches[len(done):]
    show = progress if progress is not None else len(batches) > 1
    if show:
        from tqdm.auto import tqdm

        todo = tqdm(todo, desc=f"DLA by {by}", unit="batch", initial=len(done), total=len(batches))
    run = lambda batch: run_trace(model, plan, batch, recipe, make_args(batch), remote, intervene)  # noqa: E731
    readouts, failed, error = run_all(run, todo, remote)
    readouts = list(done) + readouts
    order = list(order) if order is not None else list(range(sum(len(b.prompts) for b in batches)))
    if error is None:
        return in_user_order(_assemble(model, plan, batches, readouts, by, tolerance, stop, sources), order)
    k = len(readouts)
    ran = order[:sum(len(b.prompts) for b in batches[:k])]  # the user's indices of the prompts that ran
    covered = tuple(sorted(ran))
    partial = None
    if readouts:  # its rows in the user's order too: rank the indices that ran
        partial = in_user_order(_assemble(model, plan, batches[:k], readouts, by, tolerance, stop, sources),
                                [covered.index(i) for i in ran])
    raise RemoteBatchError(
        f"request {k + 1} of {len(batches)} failed: {error}\n\nThe {k} request(s) before it completed: their "
        f"attribution ({len(covered)} prompt(s)) is kept in this error's .partial; call .resume() to send the "
        f"{len(batches) - k} remaining request(s) and get the whole attribution.",
        partial=partial, done=covered, failed_batch=k, cause=error,
        resume=lambda: _run_batches(model, plan, batches, recipe, make_args, by, remote, progress, tolerance, stop,
                                    done=tuple(readouts), intervene=intervene, sources=sources, order=order),
    ) from error


def _assemble(model, plan, batches, readouts, by, tolerance, stop, sources=None) -> Attribution:
    """One self-checked ``Attribution`` from each batch's ``Readout`` (in the batches' order)."""
    readout = Readout(
        **{name: torch.cat([getattr(r, name) for r in readouts]).float()
           for name in ("values", "constant", "logit", "output_logit", "scale") + Readout._SCALARS[6:]},
        head_error=torch.stack([r.head_error for r in readouts]).max(),
        norm_fit_error=torch.stack([r.norm_fit_error for r in readouts]).max(),
    )
    labels = plan.labels(by, stop, sources)  # built once: by="neuron" on a large model has ~10^5-10^6 of them
    error, checked = self_check(readout, plan, by, model_dtype(model), tolerance, labels=labels)
    contrast_tokens = [b.contrast_tokens for b in batches]
    return Attribution(
        values=readout.values,
        labels=labels,
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
    intervene=None,
    sources: dict | None = None,
) -> Attribution:
    """Attribute the logit of ``target`` (minus ``contrast``) at ``position`` to the model's components.

    Args:
        model: a ``StandardizedTransformer`` (``dla_recipes.load``). A transformers model, an nnsight
            ``LanguageModel``, a local model folder or a short name (``"smollm2"``) is loaded for you with
            ``load`` (default dtype and device, once per model); a hub id is refused: ``load`` it first.
        prompts: a string or a list / tuple / generator of strings (a batch, padded as nnsight pads).
        target, contrast: a token string (``" Paris"``) or id (an int, numpy integer or integer tensor); one for
            all prompts or one per prompt (a list, array or tensor). A contrast equal to the target gives 0.
        position: the attributed position; negative counts from the end of each prompt's own tokens, so padding
            never shifts it.
        by: ``"block"`` (embed, then each block's terms), ``"head"``, ``"neuron"`` (MLP neurons, and the neurons
            of every routed expert), ``"expert"`` (one component per routed expert) or ``"source"`` (``L3.H5.S2``:
            head 5's part read from the prompt's own token 2; needs eager attention, see ``dla_recipes.sources``).
        remote: ``True`` to run on NDIF (host from nnsight's config / ``NDIF_HOST``, key from ``NDIF_API_KEY``),
            or a server URL such as ``"http://127.0.0.1:PORT"``. The math runs server side; only the result returns.
        batch_size: prompts per forward pass (one trace, one remote request each); default: all in one.
        progress: show a progress bar over the batches (default: when there is more than one).
        tolerance: relative tolerance of the self-check (default by dtype: 1e-4 in float32).
        intervene: ``fn(model)``, nnsight code run in the same forward pass before the attribution reads it: set
            or edit any module's input or output, at any block (in forward order, nnsight's rule within one
            function): zero a head's slice of ``o_proj``'s input, patch in a value computed earlier, add a
            steering vector to what a sublayer writes. The attribution is then of the *edited* forward pass: its
            parts sum to the edited model's own logit, and an ablated head's direct part is 0. It runs once per
            batch (``batch_size``) on that batch's rows, and with ``remote`` it travels with the request (by its
            source: give a ``def`` or a lambda, and pass the tensors it uses as defaults or globals).
        sources: ``by="source"`` only: ``dict(layers=[...], top_heads=k)`` splits only these blocks' heads, or
            only the ``k`` heads with the largest ``|by="head"|`` part (one more forward pass picks them); the
            other heads stay whole (``L3.H5``). Default: every head. Sources are ``S0 .. S{n-1}`` with ``n`` the
            largest attributed own position plus one; a prompt has zeros for sources it does not have.

    Returns:
        An ``Attribution``: ``values [batch, n_components]``, ``labels``, ``constant [batch]``, ``logit [batch]``,
        ``error``. Raises ``ExactnessError`` when the parts do not sum to the model's own logit.
    """
    model, prompts, batch_size, tolerance = check_arguments(model, prompts, by, batch_size, tolerance, remote)
    if intervene is not None and not callable(intervene):
        raise InputError(f"intervene must be a function fn(model), not {type(intervene).__name__}")
    plan = build_plan(model)
    targets = per_prompt(target, len(prompts), "target")
    contrasts = None if contrast is None else per_prompt(contrast, len(prompts), "contrast")
    groups = _groups(model, plan, prompts, batch_size)
    batches = [
        prepare(model, [prompts[i] for i in g], [targets[i] for i in g],
                None if contrasts is None else [contrasts[i] for i in g], position)
        for g in groups
    ]
    if sources is not None and by != "source":
        raise InputError(f"sources=... chooses the heads by='source' splits; it means nothing with by={by!r}")
    make_args = lambda b: (plan, b.positions, b.targets, b.contrasts, by)  # noqa: E731
    split = None
    if by == "source":
        from . import sources as source_split

        layers, top = source_split.parse(plan, sources)
        source_split.check_model(model, plan, layers)
        heads = None
        if top is not None:
            heads = attribute(model, prompts, target, contrast=contrast, position=position, by="head", remote=remote,
                              batch_size=batch_size, progress=progress, tolerance=tolerance, intervene=intervene)
        count = max(own for b in batches for own in b.own_positions) + 1
        split = source_split.choose(plan, layers, top, count, heads)
        make_args = lambda b: (plan, b.positions, b.targets, b.contrasts, by, split, source_split.offsets(b))  # noqa: E731
    try:
        return _run_batches(model, plan, batches, direct_logit_attribution, make_args, by, remote, progress, tolerance,
                            intervene=intervene, sources=split, order=[i for g in groups for i in g])
    except ExactnessError as error:
        if intervene is None:
            raise
        raise type(error)(f"{error}\n\n{EDIT_HINT}") from error  # NonFiniteError stays one


# What an ExactnessError most likely means when the forward pass was edited.
EDIT_HINT = (
    "The forward pass was edited: an edit that adds to the residual stream itself (a block's output, "
    "layers_output, nnterp's model.steer) writes a vector that no component wrote, so the parts cannot sum to the "
    "logit. Add it to what a sublayer writes instead (e.g. model.layers[i].mlp.output), where it is attributed to "
    "that sublayer."
)


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
    if by == "source":
        raise InputError("attribute_direction does not split heads by source yet: use by='head'")
    model, prompts, batch_size, tolerance = check_arguments(model, prompts, by, batch_size, tolerance, remote)
    plan = build_plan(model)
    stop = plan.stop_before(check_int(layer, "layer"), sublayer)
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
        stop=stop, order=[i for g in groups for i in g],
    )
    return replace(attr, target_tokens=(), read_by=f"L{stop[0]}.{reads}")
