"""The plan stage: the family table resolved against one model (client side, cached), and its components.

``build_plan(model)`` returns a ``Plan``: per block, the terms it writes with their shapes and kinds; the plan lists
the components an attribution has at each granularity (``Plan.components(by)``, ``Plan.labels(by)``).
``plan.sources`` decides, before any forward pass, which heads ``by="source"`` splits; ``head_slice(model, layer,
head)`` says which features of which projection's input are one head (``plan.heads``), for editing it in nnsight.
"""

from ..components import Component, Components
from .build import build_plan, layer_terms, module_at
from .heads import HeadSlice, head_slice
from .plan import Plan, PlannedTerm, Sources, Stop

__all__ = [
    "Component",
    "Components",
    "HeadSlice",
    "Plan",
    "PlannedTerm",
    "Sources",
    "Stop",
    "build_plan",
    "head_slice",
    "layer_terms",
    "module_at",
]
