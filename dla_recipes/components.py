"""``Component``: the record naming one column of an attribution (layer, term, part, index, source).

The plan lists them (``Plan.components(by)``), the result carries them (``Attribution.components``), and every view
of the result (``blocks``, ``heads``, ``grid``, ``sources``, the plots) reads them; the labels (``"L3.H5"``) are
derived from them, and ``parse_label`` reads one back (for an ``Attribution`` built by hand from labels).
"""

from __future__ import annotations

import re
from typing import NamedTuple

_LABEL = re.compile(r"^L(\d+)\.(?:(?:(E)(\d+)|(shared))(?:\.N(\d+))?|H(\d+)(?:\.S(\d+))?|N(\d+)|(\w+))$")


class Component(NamedTuple):
    """One column of an attribution.

    Attributes:
        layer: the block (None: the embedding).
        term: the term's name (``"embed"``, ``"attn"``, ``"mlp"``, ``"experts"``, ...).
        part: None (the term whole, or a split term's rest: its biases), ``"head"``, ``"neuron"``, ``"expert"`` or
            ``"shared"`` (a shared expert, whole or by neuron).
        index: the head, neuron or expert index (None for a rest or a whole shared expert).
        source: ``by="source"``: the source position (an index into the prompt's own tokens) of a split head.
        expert: an expert's neuron (``part="neuron"``): its expert index, or ``"shared"``.
    """

    layer: int | None
    term: str
    part: str | None = None
    index: int | None = None
    source: int | None = None
    expert: int | str | None = None

    @property
    def label(self) -> str:
        """``"embed"``, ``"L3.attn"``, ``"L3.H5"``, ``"L3.H5.S2"``, ``"L3.N127"``, ``"L3.E2"``, ``"L3.E2.N17"``,
        ``"L3.shared"``, ``"L3.shared.N5"``."""
        if self.layer is None:
            return self.term
        if self.part is None:
            return f"L{self.layer}.{self.term}"
        if self.part == "head":
            return f"L{self.layer}.H{self.index}" + ("" if self.source is None else f".S{self.source}")
        if self.part == "shared":
            return f"L{self.layer}.shared"
        if self.part == "expert":
            return f"L{self.layer}.E{self.index}"
        owner = "" if self.expert is None else ("shared." if self.expert == "shared" else f"E{self.expert}.")
        return f"L{self.layer}.{owner}N{self.index}"


def parse_label(label: str) -> Component:
    """The ``Component`` a label names (``Component(...).label`` read back); ``"embed"`` and any label that is not
    ``L<i>.<...>`` is a whole term of no layer."""
    match = _LABEL.match(label)
    if match is None:
        return Component(None, label)
    layer, expert, e, shared, expert_neuron, head, source, neuron, term = match.groups()
    layer = int(layer)
    if head is not None:
        return Component(layer, "attn", "head", int(head), None if source is None else int(source))
    if neuron is not None:
        return Component(layer, "mlp", "neuron", int(neuron))
    if expert_neuron is not None:
        return Component(layer, "experts", "neuron", int(expert_neuron), expert="shared" if shared else int(e))
    if shared:
        return Component(layer, "experts", "shared")
    if expert:
        return Component(layer, "experts", "expert", int(e))
    return Component(layer, term)
