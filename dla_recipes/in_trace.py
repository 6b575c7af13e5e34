"""The in-trace recipe as a user calls it: one call inside your own trace, after your own edits.

    with model.trace() as tracer:
        with tracer.invoke(prompts):                           # your prompts and your edits (forward order)
            model.layers[29].self_attn.o_proj.input[:, :, 64:128] = 0
        dla = dla_recipes.trace_attribution(tracer, " Paris", contrast=" Rome", by="head")
    attr = dla.result()                                        # an Attribution of the edited forward pass

    with model.trace(prompts) as tracer:                       # or: first, then your edits
        dla = dla_recipes.trace_attribution(tracer, " Paris", contrast=" Rome", by="head")
        model.layers[29].self_attn.o_proj.input[:, :, 64:128] = 0

``trace_attribution`` takes the arguments of ``attribute`` (token strings or ids, ``contrast``, ``position``,
``by``) and opens its own empty invoke, which nnsight runs over the whole batch: it reads every block in forward
order, after the edits your invokes made at the same sites, so the parts sum to the *edited* model's own logit.

Where it may be called (anything else raises ``TraceUsageError`` saying what to do):

- in ``with model.trace() as tracer:`` (no input to ``trace`` itself), at the top level of the block, **after** the
  last ``with tracer.invoke(...)`` that adds prompts; or
- as the **first statement** of ``with model.trace(prompts) as tracer:`` (or of an invoke), before anything reads
  or edits the model: it then starts its own worker, which nnsight serves after your block at every site, so it
  sees the edits written after it. Not after an edit in the same block: one block reads modules in forward order,
  so a recipe that reads block 0 cannot follow an edit at block 29 in it.
- Edits within one block follow nnsight's rule (forward order). The attribution reads each site after every block
  that edits it, in whatever order they reach it (one released there by a ``tracer.barrier``, an empty invoke of
  edits written after the call: ``trace.order``).

To patch one prompt from another across invokes, the invoke that reads the value comes first, and the invoke that
edits waits for the same site before using it (docs/api.md, "Patching across invokes"; each form is checked against
a plain forward with the same patch as a torch hook in ``tests/test_edits_order.py``):

    with tracer.invoke(corrupt):
        h = model.layers[1].mlp.output
    with tracer.invoke(clean):
        x = model.layers[1].mlp.output                         # wait for the site ...
        x[:, -1] = h[:, -1]                                    # ... then use h (or: model.layers[1].mlp.output = h)

``model.layers[1].mlp.output = h`` alone evaluates ``h`` before it waits for the site, where the other invoke has
not bound it yet: a ``TraceUsageError`` says so (so does reading an earlier site first, or the invoke reading ``h``
written after the one using it). A ``barrier = tracer.barrier(2)`` called after the read in one invoke and before
the edit in the other works too.

Every row of the batch is attributed (each invoke's prompts, in order), at ``position`` of each row's own tokens,
with the batch exactly as nnsight assembles it from the invokes (its padding, its positions). Remotely
(``model.trace(remote=True)``) the block, and this call, run on the server: register the package first
(``nnsight.register(dla_recipes)``); only the result travels back.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import nnsight
import torch
from greenlet import getcurrent

from . import features
from .args import Check, Granularity
from .errors import TraceUsageError
from .families import family_of
from .math.frozen_norm import forget_probes
from .plan.build import plan_for
from .plan.plan import Plan
from .question import ask
from .result import layout_of
from .selfcheck import model_dtype
from .trace.order import guard_names, watch
from .trace.recipe import direct_logit_attribution
from .transport.batches import prepare_encoding

if TYPE_CHECKING:
    from .present.attribution import Attribution

_WHERE = (
    "call dla_recipes.trace_attribution(tracer, ...) either at the top level of `with model.trace() as tracer:`, "
    "after your `with tracer.invoke(prompts):` blocks (which hold your edits), or as the first statement of "
    "`with model.trace(prompts) as tracer:` (or of an invoke), before your edits"
)


@dataclass
class TracedAttribution:
    """What ``trace_attribution`` returns: filled in by the trace; ``result()`` after it gives the ``Attribution``.

    Attributes:
        plan, by: what was attributed (the labels come from them).
        prompts, target_tokens, contrast_tokens, positions: each row's text, tokens and own position.
        tolerance: a relative tolerance replacing the self-check's bound (derived from the precision the model
            computed in, read in the trace, unless given).  dtype: the dtype the model's weights are in.
        packed: ``[n, n_components + len(Readout.FIELDS)]`` the recipe's output (``Readout.pack``, one row a
            site), None until the trace has run.
        layout, reduce: where each site goes (``result.Layout``) and ``reduce`` (``"sum"`` or None), as in
            ``attribute``.
        late: ``(site, rows)`` of each site the attribution read before an edit of it (``trace.order.watch``:
            only where the trace's driver cannot make it wait); ``result()`` then raises.
    """

    plan: Plan
    by: str
    prompts: tuple
    target_tokens: tuple
    contrast_tokens: tuple | None
    positions: tuple
    tolerance: float | None
    dtype: torch.dtype = torch.float32
    packed: torch.Tensor | None = None
    layout: object = None
    reduce: str | None = None
    late: list = field(default_factory=list)

    def result(self):
        """The ``Attribution`` of the traced (edited) forward pass, self-checked: raises ``ExactnessError`` when
        the parts do not sum to the model's own logit, ``TraceUsageError`` before the trace has run."""
        # absolute imports: after a remote trace this object may be a copy whose class travelled back by value,
        # and the Attribution must be the client's own class
        from dla_recipes.errors import ExactnessError, TraceUsageError
        from dla_recipes.result import EDIT_HINT, Of, Rows, assemble
        from dla_recipes.trace.readout import Readout

        if self.packed is None:
            raise TraceUsageError("the trace has not run yet: read .result() after the `with model.trace()` block")
        if self.late:
            from dla_recipes.trace.order import late_error

            raise late_error(self.late)
        rows = Rows(self.prompts, self.target_tokens, self.contrast_tokens, self.positions)
        readouts = [Readout.unpack(self.packed)]
        try:
            of = Of(self.plan, self.by, self.dtype, self.tolerance, edits=True)
            return assemble(of, rows, readouts, layout=self.layout, reduce=self.reduce)
        except ExactnessError as failed:
            raise type(failed)(f"{failed}\n\n{EDIT_HINT}") from failed  # NonFiniteError stays one

    @property
    def value(self) -> Attribution:
        """``result()``."""
        return self.result()


def _placement(tracer) -> str:
    """Where the call is: ``"top"`` (the top level of ``model.trace()``, after its invokes) or ``"first"`` (the
    first statement of a block the model runs: ``model.trace(prompts)`` or an invoke, before it touched the model).
    Anything else raises ``TraceUsageError``."""
    from nnsight.intervention.tracer import InterleavingTracer

    if not isinstance(tracer, InterleavingTracer):
        raise TraceUsageError(f"trace_attribution needs the tracer of a running trace, not a {type(tracer).__name__}: "
                              f"{_WHERE}")
    if tracer.envoy is None or tracer.batcher is None:
        raise TraceUsageError(f"the trace is not running (called outside its `with` block?): {_WHERE}")
    interleaver = tracer.envoy.interleaver
    if not interleaver.interleaving:
        if not tracer.batcher.invokes:
            raise TraceUsageError(f"no prompts yet: {_WHERE}")
        return "top"
    worker = getattr(getcurrent(), "mediator", None)
    mediator = worker() if worker is not None else None
    if mediator is None or mediator not in interleaver.mediators or mediator.counts_at_start != interleaver.counts:
        raise TraceUsageError(
            "trace_attribution was called after the model started running: inside a `with tracer.invoke(...)` block "
            "or in `with model.trace(prompts)`, after code that reads or edits the model (one block reads modules in "
            f"forward order, so the attribution could not read block 0 after an edit at a later block): {_WHERE}"
        )
    return "first"


def _batched_encoding(tracer) -> dict:
    """``{"input_ids", "attention_mask"}`` ``[batch, seq]``: the batch nnsight will run, from the invokes so far."""
    _, kwargs = tracer.envoy._batch(tracer.batcher.invokes, tracer.fn)  # nnsight's own tokenization and padding
    if "input_ids" not in kwargs:
        raise TraceUsageError("the invokes' inputs are not token ids or text: trace_attribution attributes text models")
    return {"input_ids": kwargs["input_ids"], "attention_mask": kwargs.get("attention_mask")}


def _run_alongside(interleaver, run) -> None:
    """Start ``run()`` as one more whole-batch worker of the running trace, after the ones already there.

    Called from the first statement of a block: the interleaver is still starting its workers (the model has not
    run), and it starts one appended to its list too. At every site the workers are served in list order, so this
    one reads each site after the user's blocks have edited it. (nnsight 0.8's ``Mediator``: a block of code run as
    a greenlet in step with the model.)
    """
    from nnsight.intervention.interleaver import Mediator

    code = compile("_dla_run()", "<dla_recipes.trace_attribution>", "exec")
    mediator = Mediator(code, {"__builtins__": builtins}, {"_dla_run": run})
    mediator.batch_group = None  # the whole batch, as an empty invoke
    interleaver.mediators.append(mediator)


def _check_batch(model, shape: tuple) -> None:
    """Inside the recipe's invoke: the batch that runs is the one the call saw (no invoke added after it)."""
    args, kwargs = model.inputs  # the model call's own arguments: read before any block
    ids = kwargs.get("input_ids", args[0] if args else None)
    ran = tuple(ids.shape) if ids is not None else shape
    if ran != shape:
        raise TraceUsageError(
            f"the batch that ran is [batch, seq] = {list(ran)} but was {list(shape)} when trace_attribution was called: an invoke was "
            f"added after it; {_WHERE}"
        )


def trace_attribution(
    tracer,
    target,
    *,
    contrast=None,
    position=-1,
    by: Granularity = "block",
    dictionaries: dict | None = None,
    sources: dict | None = None,
    intervene=None,
    check: Check = "logit",
    tolerance: float | None = None,
    reduce: str | None = None,
    remote=False,
    blocking: bool = True,
    batch_size: int | None = None,
    progress: bool | None = None,
    fast=True,
) -> TracedAttribution:
    """Attribute the logit of ``target`` (minus ``contrast``) inside your own trace, after your edits.

    Call it in ``with model.trace() as tracer:`` after your ``with tracer.invoke(...)`` blocks, or as the first
    statement of ``with model.trace(prompts) as tracer:`` (see the module docstring for what is allowed where). The
    attribution is of the forward pass as your code edited it.

    Args:
        tracer: the ``tracer`` of ``with model.trace() as tracer:``.
        target, contrast, position, by, dictionaries, check, tolerance, reduce, fast: as in ``attribute``; one
            target for every row of the batch or one per row (the rows of all invokes, in order); several
            positions give a ``PositionAttribution``; ``reduce``: None or ``"sum"``.
        sources, intervene, remote, blocking, batch_size, progress: refused, each with its reason
            (``dla_recipes.question.REFUSED``): your trace is the edit, the batch and where it runs.

    Returns:
        A ``TracedAttribution``; after the trace, ``.result()`` is the ``Attribution`` (labels, ``error``,
        ``top``, ``to_frame``), self-checked against the edited model's own logit.
    """
    question = ask("trace_attribution", by=by, dictionaries=dictionaries, sources=sources, intervene=intervene,
                   check=check, tolerance=tolerance, reduce=reduce, remote=remote, blocking=blocking,
                   batch_size=batch_size, progress=progress, fast=fast)
    placement = _placement(tracer)
    encoding = _batched_encoding(tracer)
    model = tracer.envoy
    batch = prepare_encoding(model, encoding, target, contrast, position)
    if not question.fast.probes:  # the general path: every norm probed anew
        forget_probes(getattr(model, "_module", model))
    plan = plan_for(model, family_of(model))  # not build_plan's cache: remotely this runs on the server
    if question.dictionaries is not None:
        plan = features.attach(model, plan, question.dictionaries)
    shape = tuple(encoding["input_ids"].shape)
    reading = question.reading(edits=True)
    handle = TracedAttribution(
        plan=plan, by=by, prompts=batch.site_prompts, target_tokens=batch.target_tokens,
        contrast_tokens=batch.contrast_tokens, positions=batch.own_positions,
        tolerance=question.tolerance, dtype=model_dtype(model),
        layout=layout_of([batch], [list(range(len(batch.prompts)))], model.tokenizer), reduce=reduce,
    )
    positions, targets, contrasts, rows = batch.positions, batch.targets, batch.contrasts, batch.rows
    guard_names(tracer.envoy.interleaver.mediators)  # the user's blocks: a name used before another binds it
    late = handle.late
    if placement == "first":

        def run():
            watch(late)  # served at each site after every block still waiting there (a barrier's, a later invoke's)
            _check_batch(model, shape)
            handle.packed = nnsight.save(direct_logit_attribution(model, plan, positions, targets, contrasts, by,
                                                                  reading=reading, rows=rows).pack())

        _run_alongside(tracer.envoy.interleaver, run)
        return nnsight.save(handle)
    with tracer.invoke():
        watch(late)
        _check_batch(model, shape)
        packed = direct_logit_attribution(model, plan, positions, targets, contrasts, by, reading=reading,
                                          rows=rows).pack()
        handle.packed = nnsight.save(packed)
    return nnsight.save(handle)
