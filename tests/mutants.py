"""Planted faults ("mutants") of the package, for ``test_mutants.py``: each is a patch a subprocess applies at import.

``tests/conftest.py`` reads ``DLA_MUTANT=<name>`` when it is imported and calls ``apply(name)``; ``test_mutants``
then runs ``TARGETS`` (a few tests that must see the fault) in that subprocess and expects them to fail. Each patch
wraps one function of the package (its output, or the arguments it is called with), never its body, so it holds
while the function's code changes; the wrapped functions are looked up by name at call time (a kind module's
``read`` / ``score`` through ``trace.terms.KINDS``, ``score_term`` and ``frozen_at`` as globals of ``trace.terms``).

A mutant that keeps every block's sum (parts moved within a block, a sign moved into the rest) is invisible to the
tests that compare sums to the model's own logit; only the single-part tests (``test_single_parts.py``) catch it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

ENV = "DLA_MUTANT"


@dataclass(frozen=True)
class Mutant:
    """One planted fault: ``target`` is ``"module:function"``, ``wrap(original) -> replacement``; ``needs``: the
    parameters of the target the wrapper reads by name (checked when the patch is applied, so a renamed parameter
    breaks the harness loudly instead of failing every test with a KeyError that would pass for a kill)."""

    name: str
    what: str
    target: str
    wrap: Callable
    needs: tuple[str, ...]


def bound(function, args, kwargs) -> inspect.BoundArguments:
    """``function``'s arguments by name (robust to arguments moving between positional and keyword)."""
    arguments = inspect.signature(function).bind(*args, **kwargs)
    arguments.apply_defaults()
    return arguments


def on_parts(mode: str, change: Callable):
    """Wrap a kind module's ``score``: when called with ``mode``, replace its ``(parts, rest, ...)`` output by
    ``change(parts, rest)`` (the other outputs kept)."""

    def wrap(original):
        @functools.wraps(original)
        def mutated(*args, **kwargs):
            result = original(*args, **kwargs)
            if bound(original, args, kwargs).arguments["term"].mode != mode:
                return result
            parts, rest = change(result[0], result[1])
            return (parts, rest, *result[2:])
        return mutated
    return wrap


def negate_term(name: str):
    """Wrap ``trace.terms.score_term``: the whole score (parts and rest) of every term called ``name`` negated."""

    def wrap(original):
        @functools.wraps(original)
        def mutated(*args, **kwargs):
            result = original(*args, **kwargs)
            if bound(original, args, kwargs).arguments["term_at"].planned.term.name != name:
                return result
            return (-result[0], *result[1:])
        return mutated
    return wrap


def one_position_earlier(original):
    """Wrap a reader called with ``sites`` (``trace.readers.Sites``): it reads one position earlier (clamped at 0)."""

    @functools.wraps(original)
    def mutated(*args, **kwargs):
        arguments = bound(original, args, kwargs)
        sites = arguments.arguments["sites"]
        arguments.arguments["sites"] = type(sites)(sites.rows, (sites.positions - 1).clamp(min=0), sites.batch)
        return original(*arguments.args, **arguments.kwargs)
    return mutated


def sign_into_rest(parts, rest):
    """The parts negated and twice their sum moved into the rest: every block's sum unchanged."""
    return -parts, rest + 2 * parts.sum(-1)


def on_features(change: Callable):
    """Wrap ``trace.kinds.features.split``: its columns ``[n, d_sae + 2 (+1)]`` (latents, bias, (skip,) error)
    replaced by ``change(columns, d_sae)``."""

    def wrap(original):
        @functools.wraps(original)
        def mutated(*args, **kwargs):
            columns = original(*args, **kwargs)
            return change(columns, bound(original, args, kwargs).arguments["dictionary"].width)
        return mutated
    return wrap


def _rolled(columns, width):
    out = columns.clone()
    out[:, :width] = columns[:, :width].roll(1, -1)
    return out


def _error_dropped(columns, width):
    out = columns.clone()
    out[:, -1] = 0
    return out


def on_group(mode, change: Callable):
    """Wrap ``trace.plain.products`` (the common case's lane): a group of ``mode`` (None: whole terms) has its
    parts ``[n, members(, parts)]`` replaced by ``change(parts)``."""

    def wrap(original):
        @functools.wraps(original)
        def mutated(*args, **kwargs):
            parts = original(*args, **kwargs)
            return change(parts) if bound(original, args, kwargs).arguments["group"].mode == mode else parts
        return mutated
    return wrap


LINEAR = "dla_recipes.trace.kinds.linear"
PLAIN = "dla_recipes.trace.plain:products"
FEATURES = "dla_recipes.trace.kinds.features:split"
MUTANTS: dict[str, Mutant] = {m.name: m for m in (
    Mutant("neurons_rolled", "each neuron's part moved to the next neuron of its block (sums unchanged)",
           f"{LINEAR}:score", on_parts("neurons", lambda parts, rest: (parts.roll(1, -1), rest)), ("term",)),
    Mutant("heads_permuted", "each block's head parts in reverse order (sums unchanged)",
           f"{LINEAR}:score", on_parts("heads", lambda parts, rest: (parts.flip(-1), rest)), ("term",)),
    Mutant("experts_rolled", "each routed expert's part moved to the next expert of its block (sums unchanged)",
           "dla_recipes.trace.kinds.experts:score", on_parts("experts", lambda parts, rest: (parts.roll(1, -1), rest)),
           ("term",)),
    Mutant("neuron_signs_into_rest", "every neuron's part negated, the difference put in its block's rest (sums "
           "unchanged)", f"{LINEAR}:score", on_parts("neurons", sign_into_rest), ("term",)),
    Mutant("mlp_negated", "the mlp term's whole score negated (its parts and rest)",
           "dla_recipes.trace.terms:score_term", negate_term("mlp"), ("term_at",)),
    Mutant("projection_input_one_earlier", "the output projections' inputs read one position before the attributed "
           "one", f"{LINEAR}:read", one_position_earlier, ("sites",)),
    Mutant("norms_frozen_one_earlier", "the post-norms (and stream norms) frozen at the position before the "
           "attributed one", "dla_recipes.trace.terms:frozen_at", one_position_earlier, ("sites",)),
    Mutant("lane_heads_permuted", "in the common case's lane, each block's head parts in reverse order (sums "
           "unchanged)", PLAIN, on_group("heads", lambda parts: parts.flip(-1)), ("group",)),
    Mutant("lane_neurons_rolled", "in the common case's lane, each neuron's part moved to the next neuron of its "
           "block (sums unchanged)", PLAIN, on_group("neurons", lambda parts: parts.roll(1, -1)), ("group",)),
    Mutant("lane_blocks_negated", "in the common case's lane, every term read whole negated", PLAIN,
           on_group(None, lambda parts: -parts), ("group",)),
    Mutant("features_permuted", "each dictionary latent's part moved to the next latent (sums unchanged)",
           FEATURES, on_features(_rolled), ("dictionary",)),
    Mutant("features_error_dropped", "a dictionary's error part left out (set to 0)", FEATURES,
           on_features(_error_dropped), ("dictionary",)),
)}

# What every mutant's subprocess runs: the single-part tests on a family of each group, and the sum tests on a few
# families (these catch what changes a block's sum; they cannot catch a part moved within a block).
SINGLE = "tests/test_single_parts.py::test_each_part_is_the_first_principles_part"
FAMILIES = "tests/test_families.py::test_parts_sum_to_the_models_logit"
TARGETS: tuple[str, ...] = (
    *(f"{SINGLE}[{case}]" for case in (
        "llama-head", "llama-neuron", "gpt2-head", "gpt2-neuron", "gemma2-head", "gemma2-neuron", "falcon-neuron",
        "mixtral-expert")),
    *(f"{FAMILIES}[{case}]" for case in ("llama-head", "llama-neuron", "gemma2-head", "gemma2-neuron",
                                         "mixtral-neuron")),
    "tests/test_features.py::test_each_latent_bias_skip_error_is_the_dictionarys_own[llama-L1.mlp-plain]",
)


def apply(name: str) -> str:
    """Patch the package with the mutant ``name``; returns the line the test session's header shows."""
    if name not in MUTANTS:
        raise KeyError(f"{ENV}={name!r}: no such mutant (known: {', '.join(MUTANTS)})")
    mutant = MUTANTS[name]
    module_name, function_name = mutant.target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, function_name)
    missing = set(mutant.needs) - set(inspect.signature(original).parameters)
    if missing:
        raise TypeError(f"mutant {name}: {mutant.target} has no parameter {', '.join(sorted(missing))}; update "
                        "tests/mutants.py")
    setattr(module, function_name, mutant.wrap(original))
    return f"dla mutant applied: {name} ({mutant.target})"
