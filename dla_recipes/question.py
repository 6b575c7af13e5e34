"""What a call asks beside its target: one frozen ``Question``, resolved once from any verb's keyword options.

Every verb (``attribute``, ``attribute_direction``, ``attribute_generation``, ``attribute_scores``,
``attribute_dataset``, ``trace_attribution``) takes the same options with the same names and defaults and hands them
to ``ask``, which checks them all at once (every bad option in one ``InputError``, each message naming the fix) and
returns a ``Question``. Below the verbs nothing checks an option again: a stage reads the fields it uses.

    question = ask("attribute", by="head", dictionaries={"L2.mlp": sae}, check="adds")
    question.by, question.edits, question.stats        # "head", False, None

A verb that cannot take an option says why in ``REFUSED`` (one table, read by ``ask``), never deep in its code.
``Fast`` is the fast paths a call may take (each one the same numbers as the general path, or within its stated
rounding): ``fast=False`` runs the general path, as a test of it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from .args import (
    Check,
    Granularity,
    check_batch_size,
    check_check,
    check_granularity,
    check_remote,
    check_tolerance,
)
from .errors import InputError
from .plan.sources import OPTIONS as SOURCE_OPTIONS
from .plan.sources import UPSTREAM
from .present.stats import Stats, as_stats, check_reduce
from .trace.reading import Reading


@dataclass(frozen=True)
class Fast:
    """The fast paths a call may take; each is keyed on what it depends on, and ``Fast(False, ...)`` is the general
    path (the same numbers: ``tests/test_fast_paths.py``).

    Attributes:
        reuse: keep, between local calls, what depends only on the weights and the targets (the head, each term's
            direction, the pull-backs): keyed on the targets and a stamp of every parameter (``transport.reuse``).
        memo: keep a call's batches and layout for the same question asked again: keyed on the prompts, targets,
            positions, batch size and the tokenizer's state (``transport.memo``).
        lane: score every term after the forward pass in a few products when every term is written straight into
            the stream (``trace.plain``): kept in the call's ``Prepared`` record, keyed on the stop, the
            granularity and whether the call reads the model's rounding.
        probes: take each norm's probe from the last call (``math.frozen_norm.probe_norm``): kept on the norm
            module, keyed on each parameter's identity, storage, in-place version, dtype and device and the width
            it reads. False: every norm of the model probed anew in this call.
    """

    reuse: bool = True
    memo: bool = True
    lane: bool = True
    probes: bool = True


GENERAL = Fast(reuse=False, memo=False, lane=False, probes=False)


@dataclass(frozen=True)
class Question:
    """What a call asks beside its target (see the module docstring); made by ``ask``, never by hand.

    Attributes:
        by: ``"block"``, ``"head"``, ``"neuron"``, ``"expert"`` or ``"source"``.
        dictionaries: ``{"L12.mlp": sae, ...}``: terms (or the stream entering a block) split into latents.
        sources: ``by="source"``'s choice of heads and upstream split (``dict(layers=, top_heads=, upstream=)``).
        intervene: ``fn(model)``, nnsight code editing the forward pass before it is read.
        check: ``"logit"`` or ``"adds"`` (``dla_recipes.selfcheck``, ``dla_recipes.math.adds``).
        tolerance: a relative tolerance replacing the derived bound, or None.
        reduce: None, ``"sum"``, ``"stats"`` or a ``Stats``.
        blocking: False: a remote call returns a ``RemoteJob`` handle at once.
        compare: ``attribute_dataset``'s second condition (a ``Versus`` or a column name), or None: the one
            option of one verb only (the statistics of per-row differences; ``attribute``'s own form is
            ``reduce=Stats(paired=True)`` over ``clean + corrupted`` prompts).
        batch_size: prompts per forward pass (None: the verb's default).
        progress: a progress bar (None: when there is more than one batch).
        remote: False, True (NDIF) or a server URL.
        fast: the fast paths the call may take (``Fast``).
    """

    by: Granularity = "block"
    dictionaries: Mapping | None = None
    sources: Mapping | None = None
    intervene: Callable | None = None
    check: Check = "logit"
    tolerance: float | None = None
    reduce: object = None
    blocking: bool = True
    compare: object = None
    batch_size: int | None = None
    progress: bool | None = None
    remote: bool | str = False
    fast: Fast = field(default_factory=Fast)

    @property
    def edits(self) -> bool:
        """The forward pass may be edited: each split term gets an ``.edit`` column."""
        return self.intervene is not None

    @property
    def stats(self) -> Stats | None:
        """``reduce`` as a ``Stats`` record, or None (rows, or ``"sum"``)."""
        return as_stats(self.reduce)

    def reading(self, sources=None, edits: bool | None = None) -> Reading:
        """What an in-trace call reads of this question (``trace.reading.Reading``); ``sources``: ``by="source"``'s
        chosen heads (``plan.Sources``), ``edits``: True where the forward pass may be edited outside ``intervene``
        (``trace_attribution``: the user's own trace)."""
        return Reading(self.by, sources, self.edits if edits is None else edits, self.check, self.fast.lane)

    def but(self, **changes) -> Question:
        """This question with ``changes`` (already checked values: a stage deriving one call from another)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Question(**values)


# The verbs' pairs with an option they cannot take, and why (read by ``ask``; every other pair works): a key
# ``(verb, option)`` refuses every value but the default, ``(verb, option, value)`` that value only (``by``'s name,
# ``reduce``'s "sum" or "stats").
REFUSED: dict[tuple, str] = {
    ("attribute_scores", "dictionaries"): "a score splits into [components x components] pairs a key: a "
    "dictionary's latents on both sides (16k x 16k a key) need a sparse choice of pairs that is not built yet; split "
    "the stream's writes by feature with attribute_direction(direction=the head's query direction, dictionaries=)",
    ("attribute_scores", "reduce"): "a score split is [keys, components, components] a prompt, not a row of "
    "parts a site; attribute_scores returns every prompt's (reduce a ScoreAttribution's values yourself)",
    ("attribute_scores", "blocking"): "attribute_scores returns its ScoreAttribution when the requests are back "
    "(blocking=False hands back a RemoteJob of attribute's rows)",
    ("attribute_scores", "sources"): "the keys= of attribute_scores are the sources of the score; sources= "
    "chooses which heads by='source' splits in a logit's attribution",
    ("attribute_scores", "check"): "the per-add check is not built for a score; its own check, always on, "
    "rebuilds the stream the head's norm reads, its query and its key from the components against the model's own "
    "(a write no component made into that stream fails it)",
    ("attribute_generation", "blocking"): "the answers must come back before their teacher-forced pass is built "
    "(remotely both run in the same sessions): run it blocking",
    ("attribute_dataset", "blocking"): "the chunks run one after another, each written before the next: run it "
    "blocking (out= keeps what finished, and the same call again resumes)",
    ("attribute_scores", "by", "neuron"): "a score is [components x components] pairs a key: neurons on both sides "
    "are too many pairs; split by 'block' or 'head'",
    ("attribute_scores", "by", "expert"): "a score splits by 'block' or 'head' (upstream heads): experts are not "
    "built for it",
    ("attribute_scores", "by", "source"): "the keys= of attribute_scores are the score's sources: split by 'block' "
    "or 'head'",
    ("trace_attribution", "by", "source"): "a head split by source is not built inside your own trace yet: use "
    "attribute(..., by='source', intervene=fn) for an edited forward pass, or by='head' here",
    ("trace_attribution", "sources"): "sources= chooses the heads by='source' splits, which trace_attribution does "
    "not do yet (attribute(..., by='source', sources=..., intervene=fn) does)",
    ("trace_attribution", "reduce", "stats"): "your own trace is one batch, and its rows come back: statistics over "
    "many batches are attribute(..., reduce='stats', intervene=fn) or attribute_dataset",
    ("trace_attribution", "remote"): "trace_attribution runs in your own trace: give remote= to model.trace(...)",
    ("trace_attribution", "blocking"): "trace_attribution runs in your own trace, which decides when it returns",
    ("trace_attribution", "intervene"): "in your own trace your edits are the code before trace_attribution(...)",
    ("trace_attribution", "batch_size"): "your own trace is one batch: split the prompts over several traces",
    ("trace_attribution", "progress"): "your own trace is one batch",
}


def _check_dictionaries(dictionaries) -> None:
    if dictionaries is not None and (not isinstance(dictionaries, Mapping) or not dictionaries):
        raise InputError(f"dictionaries={type(dictionaries).__name__}: give a non-empty dict such as "
                         "{'L12.mlp': sae, 'L16.resid': sae2} (see dla_recipes.features)")


def _check_sources(sources, by) -> None:
    if sources is None:
        return
    if not isinstance(sources, Mapping):
        raise InputError(f"sources={sources!r}: give a dict such as dict(layers=[3], top_heads=4, upstream='block')")
    unknown = sorted(set(sources) - set(SOURCE_OPTIONS))
    if unknown:
        raise InputError(f"sources has unknown keys {unknown}: use {', '.join(SOURCE_OPTIONS)}")
    upstream = sources.get("upstream")
    if upstream is not None and upstream not in UPSTREAM:
        raise InputError(f"sources['upstream'] must be one of {', '.join(map(repr, UPSTREAM))} (or None), "
                         f"got {upstream!r}")
    top = sources.get("top_heads")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
        raise InputError(f"sources['top_heads'] must be a positive int, got {top!r}")
    if by != "source":
        raise InputError(f"sources=... chooses the heads by='source' splits; it means nothing with by={by!r}: "
                         "add by='source', or drop sources=")


def _check_intervene(intervene) -> None:
    if intervene is not None and not callable(intervene):
        raise InputError(f"intervene must be a function fn(model), not {type(intervene).__name__}")


def _check_bool(name: str, value, allow_none: bool = False) -> None:
    if not isinstance(value, bool) and not (allow_none and value is None):
        raise InputError(f"{name}={value!r}: give True or False{' (or None)' if allow_none else ''}")


def _check_fast(fast) -> Fast:
    if fast is True or fast is None:
        return Fast()
    if fast is False:
        return GENERAL
    if not isinstance(fast, Fast):
        raise InputError(f"fast={fast!r}: give True (every fast path), False (the general path) or "
                         "dla_recipes.question.Fast(reuse=..., memo=..., lane=..., probes=...)")
    return fast


DEFAULTS = Question()


def ask(verb: str, **options) -> Question:
    """The ``Question`` of ``verb``'s keyword ``options`` (``Question``'s fields), every one checked: all the bad
    ones are named in one ``InputError``, as are the options ``verb`` cannot take (``REFUSED``, with the reason).
    An option left at its default is never refused."""
    problems: list[str] = []
    unknown = sorted(set(options) - {f.name for f in fields(Question)})
    if unknown:  # a verb passes only Question's fields: a programming error, named as one
        raise TypeError(f"ask: not options of a question: {unknown}")
    for name, value in options.items():
        reason = REFUSED.get((verb, name)) if not _is_default(name, value) else None
        reason = reason or REFUSED.get((verb, name, _named(name, value)))
        if reason is not None:
            problems.append(f"{verb} does not take {name}={_short(value)}: {reason}")
    values = {f.name: options.get(f.name, getattr(DEFAULTS, f.name)) for f in fields(Question)}

    def check(fn, *args):
        try:
            return fn(*args)
        except InputError as error:
            problems.append(str(error))
            return None

    by = check(check_granularity, values["by"])
    check(_check_dictionaries, values["dictionaries"])
    check(_check_sources, values["sources"], by)
    check(_check_intervene, values["intervene"])
    check(check_check, values["check"])
    values["tolerance"] = check(check_tolerance, values["tolerance"])
    check(check_reduce, values["reduce"])
    check(_check_bool, "blocking", values["blocking"])
    check(_check_bool, "progress", values["progress"], True)
    check(check_remote, values["remote"])
    values["batch_size"] = check(check_batch_size, values["batch_size"])
    values["fast"] = check(_check_fast, values["fast"])
    if values["blocking"] is False and not values["remote"]:
        problems.append("blocking=False (a handle to wait on) needs remote=True or a server URL")
    if problems:
        raise InputError(problems[0] if len(problems) == 1 else
                         f"{len(problems)} problems with the options:\n" + "\n".join(f"- {p}" for p in problems))
    return Question(**values)


def _named(name: str, value) -> object:
    """The value a ``(verb, option, value)`` refusal names: ``reduce``'s ``"stats"`` for a ``Stats`` record too."""
    if name == "reduce" and isinstance(value, Stats):
        return "stats"
    return value if isinstance(value, str) else None


def _is_default(name: str, value) -> bool:
    default = getattr(DEFAULTS, name)
    return value is default or (type(value) is type(default) and value == default)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
