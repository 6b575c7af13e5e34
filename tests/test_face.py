"""The public face: the verbs and their types at the top, everything else in a namespace that reads like the stage.

``dla_recipes.__all__`` lists the verbs (``load``, ``attribute``, ``attribute_direction``, ``attribute_scores``,
``trace_attribution``), their result types, the head-editing helper (``head_slice``, ``HeadSlice``) and the errors, plus the namespaces; the
in-trace readers and recipes are ``dla_recipes.trace``, the table ``dla_recipes.families``, the plan
``dla_recipes.plan``, the frozen norm ``dla_recipes.math``. ``dla_recipes.plots`` and ``dla_recipes.models`` import
by their short path too.
"""

import dataclasses
import importlib
import inspect

import dla_recipes

VERBS = {"load", "attribute", "attribute_direction", "attribute_dataset", "attribute_generation", "attribute_scores",
         "trace_attribution"}
NAMESPACES = {"families", "math", "models", "plan", "plots", "trace"}
TYPES = {"Attribution", "PositionAttribution", "ScoreAttribution", "TracedAttribution", "HeadSlice", "AttributionStats",
         "Stats"}
HELPERS = {"head_slice"}


def test_the_face_is_the_verbs_their_types_and_the_errors():
    names = set(dla_recipes.__all__)
    assert VERBS | NAMESPACES | TYPES | HELPERS <= names
    rest = names - VERBS - NAMESPACES - TYPES - HELPERS
    assert all(issubclass(getattr(dla_recipes, n), dla_recipes.DLAError) for n in rest), sorted(rest)
    assert all(inspect.ismodule(getattr(dla_recipes, n)) for n in NAMESPACES)


def test_the_namespaces_hold_the_pieces():
    for name in ("layer_input", "attention_output", "attention_head_outputs", "mlp_output", "neuron_activations",
                 "layer_output", "term_output", "direct_logit_attribution", "direction_attribution", "Readout"):
        assert callable(getattr(dla_recipes.trace, name)), name
    assert callable(dla_recipes.plan.build_plan) and callable(dla_recipes.families.family_of)
    assert dla_recipes.plan.head_slice is dla_recipes.head_slice
    assert dla_recipes.math.FrozenNorm.__name__ == "FrozenNorm"


def test_plots_and_models_import_by_their_short_path():
    assert importlib.import_module("dla_recipes.plots") is dla_recipes.plots
    assert importlib.import_module("dla_recipes.models") is dla_recipes.models
    from dla_recipes.models import default_model_path
    from dla_recipes.plots import blocks_bar

    assert callable(default_model_path) and callable(blocks_bar)


def test_every_verb_takes_every_option_by_the_same_name_and_default():
    """One question (``dla_recipes.question.Question``): each of its fields is a keyword-only option of every verb,
    with the record's default, and no verb swallows a misspelt option (no ``**kwargs``)."""
    from dla_recipes.question import DEFAULTS, REFUSED, Question, ask

    verbs = ["attribute", "attribute_direction", "attribute_generation", "attribute_scores", "attribute_dataset",
             "trace_attribution"]
    options = [f.name for f in dataclasses.fields(Question)]
    for verb in verbs:
        parameters = inspect.signature(getattr(dla_recipes, verb)).parameters
        assert not any(p.kind == p.VAR_KEYWORD for p in parameters.values()), verb
        for name in options:
            if name == "compare" and verb != "attribute_dataset":
                continue  # the one option of one verb: a dataset's second condition
            assert name in parameters, (verb, name)
            p = parameters[name]
            assert p.kind == p.KEYWORD_ONLY, (verb, name)
            default = getattr(DEFAULTS, name)
            assert p.default == default or (name == "fast" and p.default is True), (verb, name, p.default)
    assert {key[0] for key in REFUSED} <= set(verbs) and {key[1] for key in REFUSED} <= set(options)
    for key, reason in REFUSED.items():  # each refusal says its reason, naming the verb and the option
        verb, name = key[:2]
        value = key[2] if len(key) == 3 else {
            "blocking": False, "remote": True, "progress": True, "batch_size": 2, "reduce": "sum", "check": "adds",
            "compare": "corrupted", "intervene": print, "sources": {"layers": [0]},
            "dictionaries": {"L0.mlp": object()}}[name]
        extra = {"by": "source"} if name == "sources" else {}
        extra |= {"remote": True} if name == "blocking" else {}
        try:
            ask(verb, **{name: value}, **extra)
        except dla_recipes.InputError as error:
            assert reason in str(error) and f"{verb} does not take {name}=" in str(error), (verb, name, str(error))
        else:
            raise AssertionError(f"{verb} took {name}={value!r}")
