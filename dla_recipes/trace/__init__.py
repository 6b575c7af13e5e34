"""The in-trace stage: everything that runs inside ``with model.trace(...)``, locally or on an NDIF server.

The readers a recipe speaks of, the same on every family (``layer_input``, ``attention_output``,
``attention_head_outputs``, ``mlp_output``, ``neuron_activations``, ``layer_output``, ``term_output``), and the
recipes that return a ``Readout`` (``direct_logit_attribution``, ``direction_attribution``, ``decompose``).
Nothing here imports the transport, the loading or the result stages: remotely it runs by name on the server.

    with model.trace(prompt):
        h = dla_recipes.trace.mlp_output(model, 12)[:, -1]           # what block 12's MLP wrote, last position
"""

from .calls import DirectionCall, LogitCall
from .readers import (
    attention_head_outputs,
    attention_output,
    layer_input,
    layer_output,
    mlp_output,
    neuron_activations,
    term_output,
)
from .readout import Readout
from .recipe import decompose, direct_logit_attribution, direction_attribution

__all__ = [
    "DirectionCall",
    "LogitCall",
    "Readout",
    "attention_head_outputs",
    "attention_output",
    "decompose",
    "direct_logit_attribution",
    "direction_attribution",
    "layer_input",
    "layer_output",
    "mlp_output",
    "neuron_activations",
    "term_output",
]
