"""dla_recipes: exact direct logit attribution recipes for nnterp ``StandardizedTransformer`` models.

    import dla_recipes
    model = dla_recipes.load("HuggingFaceTB/SmolLM2-135M-Instruct")      # or a folder, or a transformers model
    attr = dla_recipes.attribute(model, "The Eiffel Tower is in the city of", " Paris", by="head")
    attr.top(10)                                                          # the parts sum to the model's own logit

``import dla_recipes`` first applies the nnterp-on-nnsight-0.8 compatibility fix (``dla_recipes._compat``), so it
must come before the first ``import nnterp``.
"""

from . import _compat  # noqa: F401  (must run before anything imports nnterp)
from .api import attribute, attribute_direction, load
from .attribution import Attribution
from .errors import (
    DLAError,
    ExactnessError,
    FamilyTableError,
    InputError,
    LoadError,
    NonFiniteError,
    RemoteError,
    TraceUsageError,
    UnknownFamilyError,
)
from .families import FAMILIES, ExpertsLayout, Family, LayerKind, Term, family_of
from .frozen_norm import FrozenNorm, NormProbe, probe_norm
from .in_trace import TracedAttribution, trace_attribution
from .loading import models  # noqa: F401  (dla_recipes.models: the real models fetched from PyPI)
from .plan import Plan, build_plan
from .readers import (
    attention_head_outputs,
    attention_output,
    layer_input,
    layer_output,
    mlp_output,
    neuron_activations,
    term_output,
)
from .recipe import Readout, decompose, direct_logit_attribution, direction_attribution
from .remote import RemoteBatchError

__all__ = [
    "attribute", "attribute_direction", "load", "Attribution", "trace_attribution", "TracedAttribution",
    "direct_logit_attribution", "direction_attribution", "decompose", "Readout", "build_plan", "Plan",
    "FrozenNorm", "NormProbe", "probe_norm",
    "layer_input", "attention_output", "attention_head_outputs", "mlp_output", "neuron_activations",
    "layer_output", "term_output",
    "FAMILIES", "Family", "LayerKind", "Term", "ExpertsLayout", "family_of",
    "DLAError", "InputError", "UnknownFamilyError", "FamilyTableError", "ExactnessError", "NonFiniteError",
    "RemoteError", "LoadError", "RemoteBatchError", "TraceUsageError",
]
