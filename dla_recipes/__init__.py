"""dla_recipes: exact direct logit attribution recipes for nnterp ``StandardizedTransformer`` models.

    import dla_recipes
    model = dla_recipes.load("HuggingFaceTB/SmolLM2-135M-Instruct")      # or a folder, or a transformers model
    attr = dla_recipes.attribute(model, "The Eiffel Tower is in the city of", " Paris", by="head")
    attr.top(10)                                                          # the parts sum to the model's own logit

The face is the verbs and their types: ``load``, ``attribute``, ``attribute_direction``, ``trace_attribution``,
``attribute_dataset`` (a dataset in chunks: rows, a resumable Parquet directory, statistics; ``dla_recipes.datasets``),
``Attribution``, ``PositionAttribution`` (several positions a prompt), ``AttributionStats`` and ``Stats``
(``reduce="stats"``: per-component statistics over a dataset), ``TracedAttribution``, ``head_slice`` and
``HeadSlice`` (where one head's output is, to edit it in nnsight) and the errors. The rest is reached through
namespaces: ``dla_recipes.trace`` (the in-trace readers and recipes: ``layer_input``, ``mlp_output``,
``direct_logit_attribution``, ...), ``dla_recipes.families`` (the family table), ``dla_recipes.plan``
(``build_plan``), ``dla_recipes.models`` (the real models shipped as PyPI wheels), ``dla_recipes.plots`` and
``dla_recipes.math`` (``FrozenNorm``). "How the code is laid out" in the docs says which stage lives where.

``import dla_recipes`` first applies the nnterp-on-nnsight-0.8 compatibility fix (``dla_recipes._compat``), so it
must come before the first ``import nnterp``.
"""

import sys

from . import (
    _compat,  # noqa: F401  (must run before anything imports nnterp)
    families,
    math,
    plan,
    trace,
)
from .api import attribute
from .datasets import attribute_dataset
from .direction import attribute_direction
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
from .generation import attribute_generation
from .in_trace import TracedAttribution, trace_attribution
from .loading import models
from .loading.load import load
from .plan.heads import HeadSlice, head_slice
from .present import plots
from .present.attribution import Attribution
from .present.positions import PositionAttribution
from .present.scores import ScoreAttribution
from .present.stats import AttributionStats, Stats
from .scores import attribute_scores
from .transport.remote import RemoteBatchError

# The two user-facing namespaces that live inside a stage are importable by their short path too, as os.path is:
# `import dla_recipes.plots`, `from dla_recipes.models import default_model_path`.
sys.modules[f"{__name__}.plots"] = plots
sys.modules[f"{__name__}.models"] = models

__all__ = [
    "Attribution",
    "AttributionStats",
    "DLAError",
    "ExactnessError",
    "FamilyTableError",
    "HeadSlice",
    "InputError",
    "LoadError",
    "NonFiniteError",
    "PositionAttribution",
    "RemoteBatchError",
    "RemoteError",
    "ScoreAttribution",
    "Stats",
    "TraceUsageError",
    "TracedAttribution",
    "UnknownFamilyError",
    "attribute",
    "attribute_dataset",
    "attribute_direction",
    "attribute_generation",
    "attribute_scores",
    "families",
    "head_slice",
    "load",
    "math",
    "models",
    "plan",
    "plots",
    "trace",
    "trace_attribution",
]
