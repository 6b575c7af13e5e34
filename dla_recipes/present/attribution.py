"""``Attribution``: the result of ``attribute``, a few tensors with labels, and views a researcher reads.

``values.sum(-1) + constant == logit`` for every prompt, to float error (``error`` says how close). Each column is
a ``Component`` record (layer, term, part, index, source): the views (``blocks``, ``heads``, ``sources``, ``grid``)
read the records, never the label strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..components import parse_label


@dataclass
class Attribution:
    """Per-component contributions to one logit (or logit difference) per prompt.

    Attributes:
        values: ``[batch, n_components]`` float32, in ``labels`` order (forward order).
        labels: ``"embed"``, ``"L0.attn"``, ``"L0.mlp"``, ... and ``"L3.H5"`` / ``"L3.N127"`` at head / neuron
            granularity (a block label then holds the block's rest: biases, post-norm bias).
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
    """

    values: torch.Tensor
    labels: list[str]
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
            self.components = tuple(parse_label(label) for label in self.labels)

    @property
    def total(self) -> torch.Tensor:
        """``[batch]``: ``values.sum(-1) + constant``, the reconstructed logit."""
        return self.values.sum(-1) + self.constant

    def __len__(self) -> int:
        return self.values.shape[0]

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

    def top(self, k: int = 10, prompt: int = 0, by_abs: bool = True):
        """The ``k`` largest contributions for one prompt, as a DataFrame (``component``, ``value``, ``share``).

        ``share`` is the value over the logit the parts sum to. ``by_abs=False`` ranks by signed value.
        """
        import pandas as pd

        if not -len(self) <= prompt < len(self):
            raise IndexError(f"prompt {prompt} is outside this attribution of {len(self)} prompts")
        row = self.values[prompt]
        order = torch.argsort(row.abs() if by_abs else row, descending=True)[:k]
        logit = float(self.logit[prompt])
        return pd.DataFrame(
            {
                "component": [self.labels[i] for i in order.tolist()],
                "value": row[order].numpy(),
                "share": (row[order] / logit).numpy() if logit != 0 else float("nan"),
            }
        )

    def blocks(self) -> Attribution:
        """The same attribution at block granularity: each head / neuron / expert summed into its block label.

        A split term's parts come right before its block label (which holds the term's rest), so each part is
        added to the next block label. ``blocks().values`` equals ``attribute(..., by="block").values``.
        """
        is_block = [component.part is None for component in self.components]
        keep = [j for j, block in enumerate(is_block) if block]
        owner = torch.zeros(len(self.labels), dtype=torch.long)
        target = len(keep)
        for j in reversed(range(len(self.labels))):
            target -= is_block[j]
            owner[j] = target
        values = torch.zeros(len(self), len(keep)).index_add_(1, owner, self.values)
        return replace(self, values=values, labels=[self.labels[j] for j in keep], by="block",
                       components=tuple(self.components[j] for j in keep))

    def heads(self) -> Attribution:
        """A ``by="source"`` attribution at head granularity: each head's sources summed into ``L3.H5``.

        ``heads().values`` equals ``attribute(..., by="head").values`` (to float error)."""
        if self.by != "source":
            raise ValueError(f"heads() sums a by='source' attribution's sources; this one is by={self.by!r}")
        names, owner = [], []
        for component in self.components:
            name = component._replace(source=None)
            if not names or names[-1] != name or component.source is None:
                names.append(name)
            owner.append(len(names) - 1)
        values = torch.zeros(len(self), len(names)).index_add_(1, torch.tensor(owner), self.values)
        return replace(self, values=values, labels=[name.label for name in names], by="head", components=tuple(names))

    def sources(self) -> torch.Tensor:
        """``[batch, layers, heads, sources]``: a ``by="source"`` attribution's parts laid out by layer, head and
        own source position (``S0`` = the prompt's first token); NaN for heads not split by source."""
        found = [(c.layer, c.index, c.source, j) for j, c in enumerate(self.components) if c.source is not None]
        if not found:
            raise ValueError(f"this attribution has no per-source components (by={self.by!r}); use by='source'")
        shape = [max(f[k] for f in found) + 1 for k in range(3)]
        out = torch.full((len(self), *shape), float("nan"))
        for layer, head, source, j in found:
            out[:, layer, head, source] = self.values[:, j]
        return out

    def grid(self, kind: str = "H") -> torch.Tensor:
        """``[batch, layers, parts]``: head (``kind="H"``) or neuron (``"N"``) values laid out by layer, NaN where
        absent. On a ``by="source"`` attribution, ``"H"`` sums each head's sources (``heads()``)."""
        if kind == "H" and any(c.source is not None for c in self.components):
            return self.heads().grid("H")
        part = {"H": "head", "N": "neuron"}.get(kind)
        found = [(c.layer, c.index, j) for j, c in enumerate(self.components)
                 if c.part == part and c.source is None and c.expert is None]
        if not found:
            raise ValueError(f"this attribution has no {'head' if kind == 'H' else 'neuron'} components (by={self.by!r})")
        layers = max(f[0] for f in found) + 1
        parts = max(f[1] for f in found) + 1
        out = torch.full((len(self), layers, parts), float("nan"))
        for layer, part, j in found:
            out[:, layer, part] = self.values[:, j]
        return out

    def __repr__(self) -> str:
        contrast = f" - {list(self.contrast_tokens)}" if self.contrast_tokens else ""
        what = f"direction read by {self.read_by}" if self.read_by else f"target {list(self.target_tokens)}{contrast}"
        return (
            f"Attribution({self.family}, by={self.by!r}, {len(self)} prompt(s) x {len(self.labels)} components, "
            f"{what}, logit {self.logit.tolist()}, {self.error_summary()})"
        )
