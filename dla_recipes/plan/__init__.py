"""The plan stage: the family table resolved against one model (client side, cached), and its components.

``build_plan(model)`` returns a ``Plan``: per block, the terms it writes with their shapes and kinds; the plan lists
the components an attribution has at each granularity (``Plan.components(by)``, ``Plan.labels(by)``).
``plan.sources`` decides, before any forward pass, which heads ``by="source"`` splits.
"""

from ..components import Component, Components
from .build import build_plan, layer_terms, module_at
from .plan import Plan, PlannedTerm, Sources, Stop

__all__ = ["Component", "Components", "Plan", "PlannedTerm", "Sources", "Stop", "build_plan", "layer_terms", "module_at"]
