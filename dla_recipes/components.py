"""``Component``: the record naming one column of an attribution (layer, term, part, index, source).

The plan lists them (``Plan.components(by)``), the result carries them (``Attribution.components``), and every view
of the result (``blocks``, ``heads``, ``grid``, ``sources``, the plots) reads them; the labels (``"L3.H5"``) are
derived from them, and ``parse_label`` reads one back, ``parse_labels`` a whole attribution's (for an ``Attribution``
built by hand from labels).

``Components`` holds a plan's components as runs (one per split term: its heads, its neurons, one head's sources)
and makes each ``Component`` only when it is read: ``by="neuron"`` on a large model has ~10^5-10^6 columns, and
neither they nor their labels should cost more than the attribution. ``Labels`` is the same for the labels: a
sequence of strings over the runs, each made when read, with ``index`` / ``in`` found from the runs (Llama-70B by
neuron: 2.3M labels, built in microseconds, ``tests/test_costs.py``).
"""

from __future__ import annotations

import bisect
import operator
import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

_LABEL = re.compile(
    r"^L(\d+)\.(?:(?:(E)(\d+)|(shared))(?:\.N(\d+))?|H(\d+)(?:\.S(\d+)(?:<-(\S+))?)?|N(\d+)|"
    r"(\w+)(?:\.(edit|bias|skip|error)|\.F(\d+))?)$")
DICTIONARY_PARTS = ("dropped", "bias", "skip", "error")  # a dictionary's parts besides its latents (``dla_recipes.features``)


class Component(NamedTuple):
    """One column of an attribution.

    Attributes:
        layer: the block (None: the embedding).
        term: the term's name (``"embed"``, ``"attn"``, ``"mlp"``, ``"experts"``, ...).
        part: None (the term whole, or a split term's rest: its biases), ``"head"``, ``"neuron"``, ``"expert"``,
            ``"shared"`` (a shared expert, whole or by neuron), ``"edit"`` (what a split term wrote beyond its
            parts and bias in an edited forward pass), or a dictionary's ``"feature"`` (a latent), ``"dropped"``
            (the latents not among the ``keep`` largest at a site, summed), ``"bias"``, ``"skip"``, ``"error"``
            (``dla_recipes.features``).
        index: the head, neuron or expert index (None for a rest or a whole shared expert).
        source: ``by="source"``: the source position (an index into the prompt's own tokens) of a split head.
        expert: an expert's neuron (``part="neuron"``): its expert index, or ``"shared"``.
        upstream: ``by="source"`` with ``sources=dict(upstream=...)``: the label of the component that wrote what
            the head read from the source position (``"L12.mlp"``, ``"embed"``); None on a source's rest.
    """

    layer: int | None
    term: str
    part: str | None = None
    index: int | None = None
    source: int | None = None
    expert: int | str | None = None
    upstream: str | None = None

    @property
    def label(self) -> str:
        """``"embed"``, ``"L3.attn"``, ``"L3.H5"``, ``"L3.H5.S2"``, ``"L3.N127"``, ``"L3.E2"``, ``"L3.E2.N17"``,
        ``"L3.shared"``, ``"L3.shared.N5"``, ``"L3.mlp.edit"``."""
        if self.layer is None:
            return self.term
        if self.part is None:
            return f"L{self.layer}.{self.term}"
        if self.part == "edit" or self.part in DICTIONARY_PARTS:
            return f"L{self.layer}.{self.term}.{self.part}"
        if self.part == "feature":
            return f"L{self.layer}.{self.term}.F{self.index}"
        if self.part == "head":
            return (f"L{self.layer}.H{self.index}" + ("" if self.source is None else f".S{self.source}")
                    + ("" if self.upstream is None else f"<-{self.upstream}"))
        if self.part == "shared":
            return f"L{self.layer}.shared"
        if self.part == "expert":
            return f"L{self.layer}.E{self.index}"
        owner = "" if self.expert is None else ("shared." if self.expert == "shared" else f"E{self.expert}.")
        return f"L{self.layer}.{owner}N{self.index}"


class Run(NamedTuple):
    """Consecutive components that differ in one field only: ``index`` or ``source`` is a ``range``, or
    ``upstream`` a tuple of labels (or none of them: one component)."""

    layer: int | None
    term: str
    part: str | None = None
    index: int | range | None = None
    source: int | range | None = None
    expert: int | str | None = None
    upstream: str | tuple | None = None

    @property
    def size(self) -> int:
        """How many components the run holds."""
        if isinstance(self.upstream, tuple):
            return len(self.upstream)
        varying = self.index if isinstance(self.index, range) else self.source
        return len(varying) if isinstance(varying, range) else 1

    def components(self) -> Iterator[Component]:
        """Each component of the run, in order."""
        layer, term, part, index, source, expert, upstream = self
        new = tuple.__new__
        if isinstance(upstream, tuple):
            return (new(Component, (layer, term, part, index, source, expert, c)) for c in upstream)
        if isinstance(index, range):
            return (new(Component, (layer, term, part, i, source, expert, upstream)) for i in index)
        if isinstance(source, range):
            return (new(Component, (layer, term, part, index, s, expert, upstream)) for s in source)
        return iter((new(Component, tuple(self)),))


class Components(Sequence):
    """A sequence of ``Component`` stored as ``Run``s; equal to any sequence of the same components."""

    def __init__(self, runs: Sequence[Run]):
        self.runs = tuple(run for run in runs if run.size)
        ends, total = [], 0
        for run in self.runs:
            total += run.size
            ends.append(total)
        self._ends = ends

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __iter__(self) -> Iterator[Component]:
        for run in self.runs:
            yield from run.components()

    def __getitem__(self, item):
        if isinstance(item, slice):
            return tuple(self[j] for j in range(*item.indices(len(self))))
        item, n = operator.index(item), len(self)
        if not -n <= item < n:
            raise IndexError(f"component {item} of {n}")
        k, offset = self.locate(item % n)
        layer, term, part, index, source, expert, upstream = self.runs[k]
        if isinstance(upstream, tuple):
            upstream = upstream[offset]
        elif isinstance(index, range):
            index = index[offset]
        elif isinstance(source, range):
            source = source[offset]
        return Component(layer, term, part, index, source=source, expert=expert, upstream=upstream)

    def __eq__(self, other) -> bool:
        if isinstance(other, Components) and self.runs == other.runs:
            return True
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def labels(self) -> Labels:
        """Every component's label, in order: a ``Labels`` sequence (each label made when read)."""
        return Labels(self)

    def spans(self) -> Iterator[tuple[Component, int, int]]:
        """``(first component, start, stop)`` of each run: its columns are ``start .. stop - 1``, and its
        components differ from the first in their ``index``, ``source`` or ``upstream`` only."""
        for run, start, stop in zip(self.runs, self.starts(), self._ends):
            varying = run.index if isinstance(run.index, range) else run.source
            if isinstance(varying, range) and varying.step != 1:  # not consecutive: one column at a time
                yield from ((self[j], j, j + 1) for j in range(start, stop))
            else:
                yield self[start], start, stop

    def starts(self) -> list[int]:
        """The column of each run's first component."""
        return [0, *self._ends[:-1]]

    def locate(self, item: int) -> tuple[int, int]:
        """``(run, offset in it)`` of column ``item`` (``0 <= item < len``)."""
        k = bisect.bisect_right(self._ends, item)
        return k, item - (self._ends[k - 1] if k else 0)

    def __repr__(self) -> str:
        return f"Components({len(self)} in {len(self.runs)} runs)"


_NUMBERED = re.compile(r"^(.*?)(0|[1-9]\d*)$")  # a label: its prefix and its last number (no leading zero)


class Labels(Sequence):
    """The labels of a ``Components`` sequence, in order, each made when read: ``labels[j]``, iteration, slices
    (a list), ``len``, ``label in labels`` and ``labels.index(label)`` (found from the runs, not by a scan); equal
    to any sequence of the same strings (a list of them included)."""

    def __init__(self, components: Components):
        self.components = components
        self._prefixes = [run_prefix(run) for run in components.runs]  # None: a one-component run
        self._lookup = None

    def __len__(self) -> int:
        return len(self.components)

    def __getitem__(self, item):
        if isinstance(item, slice):
            return [self[j] for j in range(*item.indices(len(self)))]
        item, n = operator.index(item), len(self)
        if not -n <= item < n:
            raise IndexError(f"label {item} of {n}")
        k, offset = self.components.locate(item % n)
        run, prefix = self.components.runs[k], self._prefixes[k]
        if prefix is None:
            return Component(*run).label
        return prefix + str(varying(run)[offset])

    def __iter__(self) -> Iterator[str]:
        for run, prefix in zip(self.components.runs, self._prefixes):
            if prefix is None:
                yield Component(*run).label
            else:
                yield from [prefix + str(v) for v in varying(run)]

    def index(self, label, start: int = 0, stop: int | None = None) -> int:
        """The column of ``label`` (its first, at or after ``start`` and before ``stop``); ValueError if none."""
        n = len(self)
        start, stop = slice(start, stop).indices(n)[:2]
        for column in self._columns(label):
            if start <= column < stop:
                return column
        raise ValueError(f"{label!r} is not one of these {n} labels")

    def __contains__(self, label) -> bool:
        return any(True for _ in self._columns(label))

    def count(self, label) -> int:
        return sum(1 for _ in self._columns(label))

    def _columns(self, label) -> Iterator[int]:
        """Every column labelled ``label``, in order."""
        if not isinstance(label, str):
            return
        if self._lookup is None:
            self._lookup = {}
            for k, (run, prefix, start) in enumerate(zip(self.components.runs, self._prefixes,
                                                          self.components.starts())):
                key = Component(*run).label if prefix is None else prefix
                self._lookup.setdefault(key, []).append((k, start))
        found = []
        for k, start in self._lookup.get(label, ()):  # a one-component run of this label
            if self._prefixes[k] is None:
                found.append(start)
        if "<-" in label:  # a path part: its source's prefix, then one of the run's upstream labels
            prefix, _, last = label.partition("<-")
            prefix += "<-"
        else:
            match = _NUMBERED.match(label)
            prefix, last = (None, None) if match is None else (match.group(1), int(match.group(2)))
        for k, start in self._lookup.get(prefix, ()) if prefix is not None else ():
            values = varying(self.components.runs[k])
            if self._prefixes[k] is not None and last in values:
                found.append(start + values.index(last))
        yield from sorted(found)

    def __eq__(self, other) -> bool:
        if isinstance(other, Labels) and self.components.runs == other.components.runs:
            return True
        if not isinstance(other, Sequence) or isinstance(other, str) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __add__(self, other) -> list[str]:
        return [*self, *other]

    def __radd__(self, other) -> list[str]:
        return [*other, *self]

    def __repr__(self) -> str:
        n = len(self)
        shown = list(self) if n <= 6 else [*self[:3], "...", *self[-2:]]
        return f"Labels([{', '.join(s if s == '...' else repr(s) for s in shown)}], {n} labels)"


def run_prefix(run: Run) -> str | None:
    """What every label of a run starts with before its varying number (``"L3.N"``, ``"L3.H5.S"``), or before its
    varying upstream label (``"L3.H5.S2<-"``, a source's path parts); None for a run of one component."""
    if isinstance(run.upstream, tuple):
        return f"L{run.layer}.H{run.index}.S{run.source}<-"
    if isinstance(run.source, range):
        return f"L{run.layer}.H{run.index}.S"
    if isinstance(run.index, range):
        return Component(run.layer, run.term, run.part, 0, run.source, run.expert).label[:-1]  # less its "0"
    return None


def varying(run: Run):
    """What varies along a run, in order: its upstream labels, its sources or its indices (a tuple or a range)."""
    if isinstance(run.upstream, tuple):
        return run.upstream
    return run.source if isinstance(run.source, range) else run.index


def parse_label(label: str) -> Component:
    """The ``Component`` a label names (``Component(...).label`` read back); ``"embed"`` and any label that is not
    ``L<i>.<...>`` is a whole term of no layer."""
    match = _LABEL.match(label)
    if match is None:
        return Component(None, label)
    layer, expert, e, shared, expert_neuron, head, source, upstream, neuron, term, edit, feature = match.groups()
    layer = int(layer)
    if head is not None:
        return Component(layer, "attn", "head", int(head), None if source is None else int(source), upstream=upstream)
    if neuron is not None:
        return Component(layer, "mlp", "neuron", int(neuron))
    if expert_neuron is not None:
        return Component(layer, "experts", "neuron", int(expert_neuron), expert="shared" if shared else int(e))
    if shared:
        return Component(layer, "experts", "shared")
    if expert:
        return Component(layer, "experts", "expert", int(e))
    if feature is not None:
        return Component(layer, term, "feature", int(feature))
    return Component(layer, term, edit)


def parse_labels(labels: Sequence[str]) -> tuple[Component, ...]:
    """The components of an attribution's labels, read back in order: ``parse_label`` of each, with each part of
    experts or neurons given the term of the block label right after its run in the same layer (its rest: ``L3.mlp``
    after ``L3.E0 .. L3.E3``, ``L3.shared_mlp`` after Granite's shared neurons). Heads are an ``attn`` term's and an
    edit names its own term, whatever follows; a run with no block label after it in its layer (its term has no
    rest: ``PlannedTerm.bare``) keeps the term its labels name."""
    parsed = [parse_label(label) for label in labels]
    owner = None  # the block label the parts read so far (backwards) sum into
    for j in reversed(range(len(parsed))):
        component = parsed[j]
        if component.part is None:
            owner = component
        elif component.part in ("edit", "feature", *DICTIONARY_PARTS):
            owner = Component(component.layer, component.term)
        elif component.part == "head":
            owner = None
        elif owner is not None and owner.layer == component.layer:
            parsed[j] = component._replace(term=owner.term)
    return tuple(parsed)
