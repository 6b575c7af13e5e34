"""The public face: the verbs and their types at the top, everything else in a namespace that reads like the stage.

``dla_recipes.__all__`` lists the verbs (``load``, ``attribute``, ``attribute_direction``, ``attribute_scores``,
``trace_attribution``), their result types, the head-editing helper (``head_slice``, ``HeadSlice``) and the errors, plus the namespaces; the
in-trace readers and recipes are ``dla_recipes.trace``, the table ``dla_recipes.families``, the plan
``dla_recipes.plan``, the frozen norm ``dla_recipes.math``. ``dla_recipes.plots`` and ``dla_recipes.models`` import
by their short path too.
"""

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
