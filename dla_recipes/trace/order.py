"""The order of the blocks at each site of a user's trace (``trace_attribution``): the attribution reads a site
after every edit of it, and a value one invoke uses before another has bound it is a clear error.

nnsight runs each block of a trace (each ``with tracer.invoke(...)``, and the attribution's own) as a worker that
waits at the sites it reads, and serves the workers waiting at a site in the order they were written: the
attribution, written last, reads each site after the user's edits there. Two things break that order:

- a block released by a ``tracer.barrier`` while a site is being served (its partner was served there first)
  arrives at the site after the workers already waiting there, the attribution among them;
- an invoke written after ``trace_attribution`` (an empty ``with tracer.invoke():`` of edits adds no rows) is
  served after it at every site.

``watch`` makes the attribution's worker wait its turn: at each visit of a site, while another worker still waits
there, the attribution is left waiting, and nnsight serves it again after that worker in the same visit (its
``Interleaver.handle``, which its subclasses call, serves a site until no worker waits on it). Where the
interleaver is not nnsight's, or after ``WAITS`` rounds, it does not wait: it records the site instead (``late``),
and ``TracedAttribution.result`` raises a ``TraceUsageError`` naming it. Two attributions in one trace do not wait
for each other.

``guard_names`` turns the ``NameError`` of a name one invoke uses before another invoke has bound it (the natural
cross-invoke assignment ``model.layers[3].mlp.output = h``) into a ``TraceUsageError`` saying what works.
"""

from __future__ import annotations

import dis

from greenlet import getcurrent
from nnsight.intervention.interleaver import Interleaver

from ..errors import TraceUsageError

WAITS = 64  # the most rounds the attribution waits at one visit of a site before it records the site instead

_STORES = {"STORE_NAME", "STORE_GLOBAL", "STORE_FAST", "STORE_DEREF"}


def rows_of(mediator) -> str:
    """Which rows of the batch a worker edits: ``"rows 3-5"``, or the whole batch (an empty invoke, an edit)."""
    group = getattr(mediator, "batch_group", None)
    if group is None:
        return "the whole batch (an empty invoke)"
    start, size = group
    return f"row {start}" if size == 1 else f"rows {start}-{start + size - 1}"


def watch(late: list) -> None:
    """Called first thing in the attribution's worker: from then on it is served at each site after every other
    worker waiting there. Where it cannot wait, each site it read while another worker still waited there is
    appended to ``late`` as ``(site, which rows that worker edits)``."""
    mediator = getcurrent().mediator()
    interleaver = mediator.interleaver
    ready = getattr(interleaver, "_ready", None)  # the workers waiting at this visit of a site (nnsight 0.8)
    if ready is None:
        return
    waits = isinstance(interleaver, Interleaver)  # nnsight's loop (its subclasses call it): serves a site till none waits
    original = mediator.handle
    mediator.dla_watched = True  # another attribution in the same trace does not wait for this one (nor it for it)
    rounds: dict = {}

    def handle(provider: str, value):
        others = [m for m in ready(provider) if not getattr(m, "dla_watched", False)]
        if others:
            visit = (provider, interleaver.counts.get(provider, 0))
            if waits and rounds.get(visit, 0) < WAITS:
                rounds[visit] = rounds.get(visit, 0) + 1
                return value  # left waiting here: served again after them, in this visit
            late.append((provider, ", ".join(rows_of(m) for m in others)))
        rounds.clear()
        return original(provider, value)

    mediator.handle = handle


def late_error(late: list) -> TraceUsageError:
    """The error for an attribution that read a site before an edit of it (``watch``'s ``late``)."""
    site, rows = late[0]
    more = f" (and {len(late) - 1} more sites)" if len(late) > 1 else ""
    return TraceUsageError(
        f"the attribution read {site}{more} before your edit of it: the block editing {rows} was still waiting at "
        "that site when the attribution was served there (released by a tracer.barrier while the site was being "
        "served, or an invoke written after trace_attribution), and this trace's driver cannot make the attribution "
        "wait for it, so the parts would be of the unedited value. Put every edit before the attribution: write the "
        "invokes that edit before calling trace_attribution, and patch across invokes without a barrier (the invoke "
        "that reads the value first; the invoke that edits reads the site, then edits it in place: "
        "`x = site` then `x[:, -1] = h[:, -1]`), or pass the edit as attribute(..., intervene=fn)."
    )


def stored_names(code) -> set[str]:
    """The names a block's code assigns (at its top level: a block runs as module-level code)."""
    return {i.argval for i in dis.get_instructions(code) if i.opname in _STORES}


def guard_names(mediators) -> None:
    """Wrap the user's blocks (their nnsight workers) so that a ``NameError`` on a name another of them assigns is
    raised as a ``TraceUsageError`` saying how to patch across invokes; any other error passes as it is."""
    blocks = [m for m in mediators if not getattr(m, "copy", True) and getattr(m, "code", None) is not None]
    stored = [stored_names(m.code) for m in blocks]
    for k, mediator in enumerate(blocks):
        original = mediator.switch

        def switch(*args, _k=k, _mediator=mediator, _original=original):
            try:
                return _original(*args)
            except NameError as error:
                name = getattr(error, "name", None)
                owners = [blocks[j] for j, names in enumerate(stored) if j != _k and name in names]
                if not owners:
                    raise
                # from None, with the NameError's own traceback: it ends at the user's line, not in this wrapper
                raise cross_invoke_error(name, _mediator, owners[0]).with_traceback(error.__traceback__) from None

        mediator.switch = switch


def cross_invoke_error(name: str, user, owner) -> TraceUsageError:
    """The error for ``name`` used in ``user``'s block before ``owner``'s block has bound it."""
    return TraceUsageError(
        f"`{name}` is not defined yet where the invoke of {rows_of(user)} uses it: the invoke of {rows_of(owner)} "
        f"assigns it, but the invokes of a trace run side by side, each up to the site it waits for, so `{name}` "
        "exists in another invoke only once the model has reached the site it is read at. To patch across invokes, "
        f"write the invoke that reads `{name}` first and, in the invoke that edits, wait for the same site before "
        f"using `{name}`: `x = site` then `x[:, -1] = {name}[:, -1]`, or `site` alone on a line then "
        f"`site = {name}` (an assignment `site = {name}` evaluates `{name}` before it waits for the site, and reading "
        f"an earlier site first evaluates it there). Or edit both prompts' rows in one invoke. "
        "The forms that work: \"Patching across invokes\" in the API reference (docs/api.md)."
    )
