"""``Attribution``: the result of ``attribute``, a few tensors with labels, and views a researcher reads.

``values.sum(-1) + constant == logit`` for every prompt, to float error (``error`` says how close). Each column is
a ``Component`` record (layer, term, part, index, source): the views (``blocks``, ``heads``, ``sources``, ``grid``)
read the records, never the label strings.

It is also a small dataset of prompts: ``attr[i]`` / ``attr[2:5]`` / ``attr[mask]`` select rows, ``len(attr)``
counts them, ``attr.save(path)`` / ``Attribution.load(path)`` keep it between sessions (``present.storage``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from ..components import Component, Components, Labels, parse_labels
from ..errors import InputError
from . import storage

# ``top(kind=...)``: which components each kind keeps.
KINDS = {
    "block": lambda c: c.part is None,  # whole terms, and a split term's rest (its biases)
    "head": lambda c: c.part == "head",  # heads, whole or by source
    "source": lambda c: c.source is not None,  # a head's part read from one source position
    "neuron": lambda c: c.part == "neuron",  # MLP neurons and experts' neurons
    "expert": lambda c: c.part == "expert",  # routed experts, whole
    "shared": lambda c: c.part == "shared",  # shared experts, whole
    "edit": lambda c: c.part == "edit",  # what a split term wrote beyond its parts and bias (an edited pass)
    "feature": lambda c: c.part == "feature",  # a dictionary's latents (dictionaries=, dla_recipes.features)
}


@dataclass(eq=False)
class Attribution:
    """Per-component contributions to one logit (or logit difference) per prompt.

    Attributes:
        values: ``[batch, n_components]`` float32, in ``labels`` order (forward order).
        labels: ``"embed"``, ``"L0.attn"``, ``"L0.mlp"``, ... and ``"L3.H5"`` / ``"L3.N127"`` at head / neuron
            granularity: a list, or (from ``attribute``) a ``Labels`` sequence that makes each label when read
            (``labels[j]``, ``labels.index(label)``, ``label in labels``, slices, equal to the list of them) (a block label then holds the term's rest: biases, post-norm bias; a split term with no bias
            anywhere has none).
        constant: ``[batch]``: the final norm's bias and ``lm_head``'s bias, read through the head (no component's).
        logit: ``[batch]``: the model's own logit (difference) that the parts sum to: before any soft-cap.
        output_logit: ``[batch]``: the model's output logit (difference): after the soft-cap where the family
            has one (Gemma 2, RecurrentGemma), else equal to ``logit``.
        error: max over prompts of ``|values.sum(-1) + constant - logit|``.
        prompts, target_tokens, contrast_tokens, positions: what was attributed.
        by: ``"block"``, ``"head"``, ``"neuron"``, ``"expert"`` or ``"source"`` (``"L3.H5.S2"``: head 5 of block
            3 reading the prompt's own token 2).  family: the family table entry's name.
        read_by: for ``attribute_direction``, the norm the direction was read through (``"L3.ln_2"``); empty for a
            logit.
        diagnostics: what the self-check measured: ``bound`` ``[batch]`` (what it allowed), ``split_rounding``,
            ``norm_fit_error``, ``head_error``, ``scale``.
        components: one ``Component`` per column, in ``labels`` order (read back from the labels when an
            ``Attribution`` is built from labels alone).
        dtype: the dtype the model computed in (``"bfloat16"``), measured where it ran: what sized the self-check's
            bound (``error_summary``); empty when unknown.

    Two attributions are ``==`` when every field is equal (tensors in dtype, shape and value).
    """

    values: torch.Tensor
    labels: Sequence[str]
    constant: torch.Tensor
    logit: torch.Tensor
    output_logit: torch.Tensor
    error: float
    prompts: tuple[str, ...] = ()
    target_tokens: tuple[str, ...] = ()
    contrast_tokens: tuple[str, ...] | None = None
    positions: tuple[int, ...] = ()
    by: str = "block"
    family: str = ""
    read_by: str = ""
    diagnostics: dict = field(default_factory=dict)
    components: tuple | None = None
    dtype: str = ""

    def __post_init__(self):
        if self.components is None:
            self.components = self.labels.components if isinstance(self.labels, Labels) else parse_labels(self.labels)

    @property
    def total(self) -> torch.Tensor:
        """``[batch]``: ``values.sum(-1) + constant``, the reconstructed logit."""
        return self.values.sum(-1) + self.constant

    def __len__(self) -> int:
        return self.values.shape[0]

    def __getitem__(self, rows) -> Attribution:
        """The attribution of some prompts: ``attr[i]`` (one prompt: ``values [1, n_components]``), ``attr[2:5]``,
        ``attr[[0, 3]]``, ``attr[mask]`` (a bool per prompt), in that order.

        Every per-prompt field follows the rows (``prompts``, ``logit``, ``diagnostics["bound"]``, ...), ``error``
        is the selected rows' own; ``diagnostics["head_error"]`` and ``["norm_fit_error"]`` stay the whole call's.
        """
        index = self._rows(rows)
        pick = torch.tensor(index, dtype=torch.long)

        def take(value):
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == len(self):
                return value[pick]
            if isinstance(value, tuple) and len(value) == len(self):
                return tuple(value[i] for i in index)
            return value

        chosen = {f.name: take(getattr(self, f.name)) for f in fields(self) if f.name not in ("labels", "components")}
        chosen["diagnostics"] = {key: take(value) for key, value in self.diagnostics.items()}
        gaps = (chosen["values"].sum(-1) + chosen["constant"] - chosen["logit"]).abs()
        chosen["error"] = float(gaps.max()) if len(index) else 0.0
        return replace(self, **chosen)

    def _rows(self, rows) -> list[int]:
        """``rows`` (an int, a slice, a sequence of ints, a bool mask) as a list of row indices."""
        return row_index(rows, len(self))

    def __iter__(self):
        """One-prompt attributions, in order (``attr[0]``, ``attr[1]``, ...)."""
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Attribution):
            return NotImplemented
        return all(storage.same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None

    def save(self, path=None):
        """Write this attribution to a file (``torch.save`` of its fields); ``Attribution.load(path)`` reads it
        back equal. Returns the path.

        This is the package's own ``save``, not nnsight's ``.save()`` (which nnsight mounts on every object to keep
        a value out of a trace): an ``Attribution`` is made after the trace, so there is nothing to keep. Inside a
        trace ``attr.save()`` without a path still marks it as nnsight would (``nnsight.save(attr)``).
        """
        if path is None:
            try:
                import nnsight

                return nnsight.save(self)
            except (ImportError, ValueError):
                raise TypeError("Attribution.save(path) writes the attribution to a file: give a path, e.g. "
                                "attr.save('attribution.pt'); Attribution.load(path) reads it back") from None
        return storage.save(self, path)

    @classmethod
    def load(cls, path) -> Attribution:
        """The attribution ``save(path)`` wrote (read with ``torch.load(..., weights_only=True)``)."""
        return cls(**storage.load(path))

    def error_summary(self) -> str:
        """``"error 3.05e-03 (bound 6.25e-02, bfloat16)"``: the largest gap between the parts and the logit, the
        bound the self-check held that prompt to (``diagnostics["bound"]``) and the dtype the model computed in
        (``dtype``)."""
        text = f"error {self.error:.2e}"
        bound, details = self.diagnostics.get("bound"), []
        if isinstance(bound, torch.Tensor) and bound.numel() == len(self) and len(self):
            worst = int((self.total - self.logit).abs().argmax())  # the prompt the error is measured on
            details.append(f"bound {float(bound.reshape(-1)[worst]):.2e}")
        if self.dtype:
            details.append(self.dtype)
        return f"{text} ({', '.join(details)})" if details else text

    def to_frame(self):
        """A pandas DataFrame: one row per component, one column per prompt (plus ``constant`` and ``logit`` rows)."""
        import pandas as pd

        columns = [f"{i}: {p[-40:]}" for i, p in enumerate(self.prompts)] or list(range(len(self)))
        frame = pd.DataFrame(self.values.T.numpy(), index=pd.Index(self.labels, name="component"), columns=columns)
        extra = pd.DataFrame(
            [self.constant.numpy(), self.logit.numpy()], index=["constant", "logit"], columns=columns
        )
        return pd.concat([frame, extra])

    def top(self, k: int = 10, prompt: int | None = 0, by_abs: bool = True, kind: str | None = None):
        """The ``k`` largest contributions for one prompt, as a DataFrame (``component``, ``value``, ``share``).

        ``share`` is the value over the logit the parts sum to. ``by_abs=False`` ranks by signed value.
        ``prompt=None``: the mean over the prompts (``share`` over the mean logit). ``kind``: only components of
        one kind: ``"head"``, ``"neuron"``, ``"expert"``, ``"shared"``, ``"source"``, ``"block"`` (whole terms
        and split terms' rests), ``"edit"`` (``L3.mlp.edit``: an edited pass's writes after a projection) or
        ``"feature"`` (a dictionary's latents, ``L3.mlp.F7``); default: all.
        """
        import pandas as pd

        if prompt is None:
            row, logit = self.values.mean(0), float(self.logit.mean())
        else:
            if not -len(self) <= prompt < len(self):
                raise IndexError(f"prompt {prompt} is outside this attribution of {len(self)} prompts")
            row, logit = self.values[prompt], float(self.logit[prompt])
        columns = torch.arange(len(self.labels))
        if kind is not None:
            if kind not in KINDS:
                raise InputError(f"kind={kind!r}: use one of {', '.join(map(repr, KINDS))}, or None for all")
            keep = KINDS[kind]
            kept = [torch.arange(start, stop) for first, start, stop in spans(self.components) if keep(first)]
            columns = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long)
            if not len(columns):
                raise InputError(f"this attribution (by={self.by!r}) has no {kind} components"
                                 + ("" if kind in ("block", "shared", "edit", "feature") else f": attribute with by={kind!r}"))
        chosen = row[columns]
        order = columns[largest(chosen.abs() if by_abs else chosen, k)]
        return pd.DataFrame(
            {
                "component": [self.labels[i] for i in order.tolist()],
                "value": row[order].numpy(),
                "share": (row[order] / logit).numpy() if logit != 0 else float("nan"),
            }
        )

    def blocks(self) -> Attribution:
        """The same attribution at block granularity: each head / neuron / expert summed into its block label.

        Each component is summed into its term's block (``L3.attn`` for ``L3.H5``, ``L3.attn.edit`` and the term's
        rest ``L3.attn`` where it has one), in forward order. ``blocks().values`` equals
        ``attribute(..., by="block").values``.
        """
        found = [(Component(first.layer, first.term), stop - start) for first, start, stop in spans(self.components)]
        blocks = list(dict.fromkeys(key for key, _ in found))
        index = {key: n for n, key in enumerate(blocks)}
        owner = torch.repeat_interleave(torch.tensor([index[key] for key, _ in found], dtype=torch.long),
                                        torch.tensor([size for _, size in found], dtype=torch.long))
        values = torch.zeros(len(self), len(blocks)).index_add_(1, owner, self.values)
        return replace(self, values=values, labels=[block.label for block in blocks], by="block",
                       components=tuple(blocks))

    def heads(self) -> Attribution:
        """A ``by="source"`` attribution at head granularity: each head's sources summed into ``L3.H5``.

        ``heads().values`` equals ``attribute(..., by="head").values`` (to float error)."""
        if self.by != "source":
            raise ValueError(f"heads() sums a by='source' attribution's sources; this one is by={self.by!r}")
        names, owner = [], []
        for component in self.components:
            name = component._replace(source=None, upstream=None)
            if not names or names[-1] != name or component.source is None:
                names.append(name)
            owner.append(len(names) - 1)
        values = torch.zeros(len(self), len(names)).index_add_(1, torch.tensor(owner), self.values)
        return replace(self, values=values, labels=[name.label for name in names], by="head", components=tuple(names))

    def sources(self) -> torch.Tensor:
        """``[batch, layers, heads, sources]``: a ``by="source"`` attribution's parts laid out by layer, head and
        own source position (``S0`` = the prompt's first token); NaN for heads not split by source."""
        found = [(c.layer, c.index, c.source, start, stop, c.upstream is not None)
                 for c, start, stop in spans(self.components)
                 if c.source is not None]  # a run's sources are consecutive, or one source's upstream parts
        if not found:
            raise ValueError(f"this attribution has no per-source components (by={self.by!r}); use by='source'")
        shape = [max(f[0] for f in found) + 1, max(f[1] for f in found) + 1,
                 max(f[2] + (1 if f[5] else f[4] - f[3]) for f in found)]
        out = torch.full((len(self), *shape), float("nan"))
        for layer, head, source, start, stop, upstream in found:  # a source split upstream (``<-L3.mlp``): its sum
            width = 1 if upstream else stop - start
            part = self.values[:, start:stop].sum(-1, keepdim=True) if upstream else self.values[:, start:stop]
            seen = torch.nan_to_num(out[:, layer, head, source:source + width], nan=0.0)
            out[:, layer, head, source:source + width] = part + seen
        return out

    def grid(self, kind: str = "H") -> torch.Tensor:
        """``[batch, layers, parts]``: head (``kind="H"``) or neuron (``"N"``) values laid out by layer, NaN where
        absent. On a ``by="source"`` attribution, ``"H"`` sums each head's sources (``heads()``)."""
        if kind == "H" and any(c.source is not None for c, _, _ in spans(self.components)):
            return self.heads().grid("H")
        part = {"H": "head", "N": "neuron"}.get(kind)
        found = [(c.layer, c.index, start, stop) for c, start, stop in spans(self.components)
                 if c.part == part and c.source is None and c.expert is None]  # a run's indices are consecutive
        if not found:
            raise ValueError(f"this attribution has no {'head' if kind == 'H' else 'neuron'} components (by={self.by!r})")
        layers = max(f[0] for f in found) + 1
        parts = max(f[1] + f[3] - f[2] for f in found)
        out = torch.full((len(self), layers, parts), float("nan"))
        for layer, first, start, stop in found:
            out[:, layer, first:first + stop - start] = self.values[:, start:stop]
        return out

    def __repr__(self) -> str:
        """One short line whatever the number of prompts: the tokens and logits summarised past a few."""
        n = len(self)
        what = f"direction read by {self.read_by}" if self.read_by else f"target {tokens(self.target_tokens)}"
        if self.contrast_tokens:
            what += f" - {tokens(self.contrast_tokens)}"
        if n <= 4:
            logit = "logit [" + ", ".join(f"{v:.4g}" for v in self.logit.tolist()) + "]"
        else:
            logit = (f"logit mean {float(self.logit.mean()):.4g} (min {float(self.logit.min()):.4g}, max "
                     f"{float(self.logit.max()):.4g})")
        prompt = f", prompt {short(self.prompts[0], 40)}" if n == 1 and self.prompts else ""
        return (f"Attribution({self.family}, by={self.by!r}, {n} prompt{'s' if n != 1 else ''} x {len(self.labels)} "
                f"components{prompt}, {what}, {logit}, {self.error_summary()})")


def largest(score: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest of ``score`` ``[n]``, largest first (ties: the lower index first): a stable
    descending argsort's first ``k``, without sorting all ``n`` (``by="neuron"`` on a large model: ~10^6)."""
    n = score.numel()
    if not 0 < k < n // 4:
        return torch.argsort(score, descending=True, stable=True)[:k]
    threshold = torch.topk(score, k).values[-1]
    if torch.isnan(threshold):  # NaN ranks first in a descending sort: leave it to the sort
        return torch.argsort(score, descending=True, stable=True)[:k]
    candidates = torch.nonzero(score >= threshold).flatten()  # every index a stable sort could put in the first k
    return candidates[torch.argsort(score[candidates], descending=True, stable=True)][:k]


def spans(components):
    """``(first component, start, stop)`` of each run of consecutive columns whose components differ only in their
    ``index`` or ``source``, each one more than the last: a plan's ``Components`` by its runs (``by="neuron"``: a
    few hundred, not a record per neuron), any other sequence one column at a time."""
    if isinstance(components, Components):
        return components.spans()
    return ((component, j, j + 1) for j, component in enumerate(components))


def row_index(rows, n: int) -> list[int]:
    """``rows`` (an int, a slice, a sequence of ints, a bool mask of ``n``) as a list of indices into ``n`` prompts:
    what ``attr[rows]`` selects (``PositionAttribution`` selects its prompts the same way)."""
    if isinstance(rows, slice):
        return list(range(n))[rows]
    if isinstance(rows, (str, bytes)):
        raise TypeError(f"attr[{rows!r}]: index rows (prompts) with an int, a slice, a list of ints or a bool "
                        "mask; a component's values are attr.values[:, attr.labels.index(label)]")
    single = isinstance(rows, numbers.Integral) or getattr(rows, "ndim", None) == 0
    items = rows.tolist() if hasattr(rows, "tolist") else rows
    items = [items] if single else list(items)
    if items and all(isinstance(item, bool) for item in items):
        if len(items) != n:
            raise IndexError(f"a mask of {len(items)} bools for an attribution of {n} prompts")
        return [i for i, keep in enumerate(items) if keep]
    index = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise TypeError(f"attr[{rows!r}]: rows are ints (or one bool per prompt), not {item!r}")
        if not -n <= item < n:
            raise IndexError(f"prompt {item} is outside this attribution of {n} prompts")
        index.append(int(item) % n)
    return index


def short(text: str, width: int = 24) -> str:
    """``repr(text)``, cut to about ``width`` characters."""
    return repr(text) if len(text) <= width else repr(text[: width - 1] + "…")


def tokens(values) -> str:
    """The distinct tokens of a column, short: ``' Paris'``, ``[' Paris', ' Rome']`` or ``7 tokens (' Paris', ...)``."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) == 1:
        return short(distinct[0])
    if len(distinct) <= 3:
        return "[" + ", ".join(short(t) for t in distinct) + "]"
    return f"{len(distinct)} tokens (" + ", ".join(short(t) for t in distinct[:3]) + ", ...)"
