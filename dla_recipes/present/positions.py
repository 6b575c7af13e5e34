"""``PositionAttribution``: what ``attribute(..., position=[...] | slice | "all")`` returns, several positions a prompt.

One forward pass attributes every (prompt, position) "site"; ``sites`` is that flat ``Attribution`` (one row a site,
prompt-major: all of prompt 0's positions in column order, then prompt 1's, ...) and ``index`` ``[batch,
n_positions]`` lays the sites out as a table: ``index[b, k]`` is the row of ``sites`` for prompt ``b``'s ``k``-th
attributed position (column ``k``), ``-1`` where prompt ``b`` has no such position (a shorter prompt: masked).

The views read that table: ``values`` ``[batch, n_positions, n_components]``, ``logit`` / ``constant`` /
``output_logit`` ``[batch, n_positions]``, NaN where masked (``mask`` says where: a masked entry is never another
prompt's number); ``at(k)`` is column ``k`` as a plain ``Attribution``; ``sum()`` adds each prompt's positions into
one ``Attribution`` (``reduce="sum"``); ``attr[i]`` / slices / masks select prompts, as ``Attribution`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..errors import InputError
from . import storage
from .attribution import Attribution, row_index, short
from .attribution import tokens as token_summary

# The per-site diagnostics ``sum()`` adds over a prompt's positions: bounds on independent errors, additive.
ADDITIVE = ("bound", "split_rounding")


@dataclass(eq=False)
class PositionAttribution:
    """Attribution of several positions per prompt: a table of sites, ``[batch, n_positions]``, over one flat
    ``Attribution``.

    Attributes:
        sites: one row per attributed (prompt, position), prompt-major (all of prompt 0's positions in column
            order, then prompt 1's, ...): a plain ``Attribution`` whose ``prompts`` / ``positions`` /
            ``target_tokens`` are per site; its parts sum to each site's logit (``sites.error``).
        index: ``[batch, n_positions]`` long: the row of ``sites`` for (prompt, column), ``-1`` where the prompt has
            no such position (masked).
        prompts: the batch's prompts, one per prompt (not per site).
        tokens: each prompt's own tokens, decoded one by one (``to_frame``'s ``token`` column, the plots); may be
            empty (``()``), the tokens then read ``""``.

    Every per-site view is ``[batch, n_positions, ...]`` with NaN (``""`` for a token, ``-1`` for a position) where
    ``mask`` is False: read ``values[mask]`` (``[n_sites, n_components]``, the sites' rows in order) or use
    ``mask`` before reducing (``values.nansum(1)``; ``sum()`` does it per prompt).
    """

    sites: Attribution
    index: torch.Tensor
    prompts: tuple = ()
    tokens: tuple = ()

    def __post_init__(self):
        self.index = torch.as_tensor(self.index, dtype=torch.long)
        if self.index.dim() != 2:
            raise InputError(f"index must be [batch, n_positions], not of shape {tuple(self.index.shape)}")
        self.prompts, self.tokens = tuple(self.prompts), tuple(tuple(t) for t in self.tokens)
        batch, n = self.index.shape[0], len(self.sites)
        if len(self.prompts) != batch or self.tokens and len(self.tokens) != batch:
            raise InputError(f"index has {batch} prompts, prompts {len(self.prompts)}, tokens {len(self.tokens)}")
        rows = self.index[self.index >= 0]
        if not torch.equal(rows, torch.arange(n)) or bool((self.index < -1).any()):
            raise InputError(f"index must number the {n} sites 0, 1, ... prompt-major (row by row, column by "
                             "column), -1 where masked")

    # -- the table ------------------------------------------------------------------------------------------------

    @property
    def mask(self) -> torch.Tensor:
        """``[batch, n_positions]`` bool: where the prompt has the column's position (False: masked)."""
        return self.index >= 0

    def _table(self, per_site: torch.Tensor, fill=float("nan")) -> torch.Tensor:
        """``per_site`` ``[n_sites, ...]`` laid out ``[batch, n_positions, ...]``, ``fill`` where masked."""
        if math.isnan(fill) and not per_site.is_floating_point():  # NaN where masked needs a float
            per_site = per_site.float()
        out = torch.full((*self.index.shape, *per_site.shape[1:]), fill, dtype=per_site.dtype, device=per_site.device)
        out[self.mask.to(per_site.device)] = per_site
        return out

    @property
    def _owner(self) -> torch.Tensor:
        """``[n_sites]`` long: each site's prompt."""
        return torch.arange(len(self)).unsqueeze(1).expand_as(self.index)[self.mask]

    def _nested(self, per_site, fill: str = "") -> tuple:
        """A per-site tuple laid out as ``[batch][n_positions]`` tuples, ``fill`` where masked."""
        return tuple(tuple(per_site[r] if r >= 0 else fill for r in row) for row in self.index.tolist())

    @property
    def values(self) -> torch.Tensor:
        """``[batch, n_positions, n_components]``, NaN where masked (``mask``)."""
        return self._table(self.sites.values)

    @property
    def constant(self) -> torch.Tensor:
        """``[batch, n_positions]``, NaN where masked."""
        return self._table(self.sites.constant)

    @property
    def logit(self) -> torch.Tensor:
        """``[batch, n_positions]``: the model's own logit (difference) at each site, NaN where masked."""
        return self._table(self.sites.logit)

    @property
    def output_logit(self) -> torch.Tensor:
        """``[batch, n_positions]``: after the soft-cap where the family has one, NaN where masked."""
        return self._table(self.sites.output_logit)

    @property
    def total(self) -> torch.Tensor:
        """``[batch, n_positions]``: ``values.sum(-1) + constant``, the reconstructed logit, NaN where masked."""
        return self._table(self.sites.total)

    @property
    def positions(self) -> torch.Tensor:
        """``[batch, n_positions]`` long: each prompt's own position index of the column (``0`` = its first token),
        ``-1`` where masked."""
        return self._table(torch.tensor(self.sites.positions, dtype=torch.long).reshape(-1), fill=-1)

    @property
    def target_tokens(self) -> tuple:
        """``[batch][n_positions]`` tuples of target tokens, ``""`` where masked."""
        return self._nested(self.sites.target_tokens)

    @property
    def contrast_tokens(self) -> tuple | None:
        """``[batch][n_positions]`` tuples of contrast tokens (``""`` where masked), or None without a contrast."""
        contrast = self.sites.contrast_tokens
        return None if contrast is None else self._nested(contrast)

    @property
    def diagnostics(self) -> dict:
        """The sites' diagnostics: per-site tensors (``bound``, ``split_rounding``, ``scale``) as ``[batch,
        n_positions]`` (NaN where masked), whole-call values (``head_error``, ...) as they are."""
        n = len(self.sites)
        return {key: self._table(v) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
                for key, v in self.sites.diagnostics.items()}

    error = property(lambda self: self.sites.error, doc="Max over the sites of ``|parts + constant - logit|``.")
    labels = property(lambda self: self.sites.labels, doc="The components' labels, as ``Attribution.labels``.")
    components = property(lambda self: self.sites.components, doc="One ``Component`` a column, as ``labels``.")
    by = property(lambda self: self.sites.by, doc="The granularity (``\"block\"``, ``\"head\"``, ...).")
    family = property(lambda self: self.sites.family, doc="The family table entry's name.")
    dtype = property(lambda self: self.sites.dtype, doc="The dtype the model computed in.")
    read_by = property(lambda self: self.sites.read_by, doc="The norm a direction was read through, or empty.")

    # -- columns and rows -----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.index.shape[0]

    @property
    def n_positions(self) -> int:
        """The number of columns (attributed positions a prompt, masked ones included)."""
        return self.index.shape[1]

    def _column(self, k: int) -> int:
        if not -self.n_positions <= k < self.n_positions:
            raise IndexError(f"position column {k} is outside this attribution of {self.n_positions} positions")
        return k % self.n_positions

    def at(self, k: int) -> Attribution:
        """Column ``k`` (negative: from the last column) as a plain ``Attribution`` of the prompts that have it, in
        batch order: what ``attribute(..., position=<that position>)`` gives for them."""
        rows = self.index[:, self._column(k)]
        return self.sites[rows[rows >= 0].tolist()]

    def site(self, prompt: int = 0, position: int = -1) -> int:
        """The row of ``sites`` of one prompt's ``position``: a column index (as ``at``), or negative, counted back
        over the prompt's own attributed columns (``-1``: its last attributed position, whatever the others'
        lengths); an IndexError where the prompt has no such position."""
        b = row_index(prompt, len(self))[0]
        if position < 0:
            own = self.index[b][self.index[b] >= 0]
            if not -len(own) <= position:
                raise IndexError(f"prompt {b} has {len(own)} attributed positions, not {-position}")
            return int(own[position])
        row = int(self.index[b, self._column(position)])
        if row < 0:
            raise IndexError(f"prompt {b} has no position in column {position} (masked: see attr.mask[{b}])")
        return row

    def __getitem__(self, rows) -> PositionAttribution:
        """Some prompts, with all their positions: ``attr[i]``, ``attr[2:5]``, ``attr[[0, 3]]``, ``attr[mask]`` (a
        bool per prompt), in that order; the columns stay (a column may become all masked)."""
        picked = row_index(rows, len(self))
        chosen = self.index[picked]
        keep = chosen >= 0
        index = torch.full_like(chosen, -1)
        index[keep] = torch.arange(int(keep.sum()))
        return PositionAttribution(self.sites[chosen[keep].tolist()], index, tuple(self.prompts[i] for i in picked),
                                   tuple(self.tokens[i] for i in picked) if self.tokens else ())

    def __iter__(self):
        """One-prompt ``PositionAttribution``\\ s, in order."""
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if not isinstance(other, PositionAttribution):
            return NotImplemented
        return (self.sites == other.sites and storage.same(self.index, other.index)
                and storage.same(self.prompts, other.prompts) and storage.same(self.tokens, other.tokens))

    __hash__ = None

    # -- views ----------------------------------------------------------------------------------------------------

    def blocks(self) -> PositionAttribution:
        """The same table at block granularity (``sites.blocks()``): equal to ``by="block"``'s values."""
        return replace(self, sites=self.sites.blocks())

    def top(self, k: int = 10, prompt: int = 0, position: int = -1, kind: str | None = None, by_abs: bool = True):
        """The ``k`` largest contributions at one site, as ``Attribution.top`` (``component``, ``value``, ``share``);
        ``position`` as in ``site`` (default: the prompt's last attributed position)."""
        return self.sites.top(k, self.site(prompt, position), by_abs=by_abs, kind=kind)

    def sum(self) -> Attribution:
        """Each prompt's positions added: an ``Attribution`` with one row a prompt (what ``reduce="sum"`` gives).

        ``values``, ``constant``, ``logit``, ``output_logit`` are the sums over the prompt's sites (in float64, then
        float32); ``diagnostics["bound"]`` and ``["split_rounding"]`` are summed too (bounds on independent errors
        add), other per-site tensors kept as ``[batch, n_positions]`` (NaN masked), whole-call values as they are;
        ``error`` is the sums' own. ``positions`` holds each prompt's positions tuple and ``target_tokens`` /
        ``contrast_tokens`` a short description (``"'w20' at 3 positions"``: the logit is their sum). A prompt with
        no attributed position sums to zeros.
        """
        s, batch, n = self.sites, len(self), len(self.sites)
        owner = self._owner

        def add(per_site: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((batch, *per_site.shape[1:]), dtype=torch.float64)
            return out.index_add_(0, owner, per_site.double()).to(per_site.dtype)

        diagnostics = {}
        for key, value in s.diagnostics.items():
            per_site = isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n
            diagnostics[key] = (add(value) if key in ADDITIVE else self._table(value)) if per_site else value
        values, constant, logit = add(s.values), add(s.constant), add(s.logit)
        gaps = (values.sum(-1) + constant - logit).abs()
        positions = self._nested(s.positions, fill=None)
        return replace(
            s, values=values, constant=constant, logit=logit, output_logit=add(s.output_logit),
            error=float(gaps.max()) if batch else 0.0, prompts=self.prompts, diagnostics=diagnostics,
            positions=tuple(tuple(p for p in row if p is not None) for row in positions),
            target_tokens=self._described(s.target_tokens) if s.target_tokens else s.target_tokens,  # a direction: ()
            contrast_tokens=None if s.contrast_tokens is None else self._described(s.contrast_tokens),
        )

    def _described(self, per_site) -> tuple[str, ...]:
        """Per prompt: ``"'w20' at 3 positions"`` (its sites' distinct tokens, summarised, and their count)."""
        out = []
        for row in self._nested(per_site, fill=None):
            own = [t for t in row if t is not None]
            out.append(f"{token_summary(own) if own else 'nothing'} at {len(own)} position{'s' * (len(own) != 1)}")
        return tuple(out)

    def to_frame(self):
        """A long pandas DataFrame: one row per (site, component), columns ``prompt`` (the prompt's index in the
        batch: ``attr.prompts[prompt]``), ``position`` (the prompt's own position index), ``token`` (the token at
        that position), ``target``, ``component``, ``value``. Each site also has a ``"constant"`` and a ``"logit"``
        row (as ``Attribution.to_frame``), so a site's parts plus its constant are its logit:
        ``frame[frame.component != "logit"].groupby(["prompt", "position"]).value.sum()``."""
        import numpy as np
        import pandas as pd

        s, n = self.sites, len(self.sites)
        owner = self._owner.tolist()
        positions = [int(p) for p in s.positions]
        tokens = [self._token(b, p) for b, p in zip(owner, positions)]
        labels = [*s.labels, "constant", "logit"]
        table = torch.cat([s.values, s.constant[:, None], s.logit[:, None]], 1)  # [n_sites, n_components + 2]
        width = len(labels)
        return pd.DataFrame({
            "prompt": np.repeat(np.array(owner, dtype=np.int64), width),
            "position": np.repeat(np.array(positions, dtype=np.int64), width),
            "token": np.repeat(np.array(tokens, dtype=object), width),
            "target": np.repeat(np.array(list(s.target_tokens) or [""] * n, dtype=object), width),
            "component": np.tile(np.array(labels, dtype=object), n), "value": table.reshape(-1).numpy(),
        })

    def _token(self, prompt: int, position: int) -> str:
        """The prompt's own token at ``position`` (``""`` without ``tokens``)."""
        own = self.tokens[prompt] if self.tokens else ()
        return own[position] if 0 <= position < len(own) else ""

    # -- files and text -------------------------------------------------------------------------------------------

    def save(self, path):
        """Write this attribution to a file (``present.storage``); ``PositionAttribution.load(path)`` reads it back
        equal. Returns the path."""
        return storage.save_positions(self, path)

    @classmethod
    def load(cls, path) -> PositionAttribution:
        """The attribution ``save(path)`` wrote (read with ``torch.load(..., weights_only=True)``)."""
        fields = storage.load_positions(path)
        return cls(Attribution(**fields.pop("sites")), **fields)

    def error_summary(self) -> str:
        """``"error 3.05e-03 (bound 6.25e-02, bfloat16) over 12 sites"``: ``Attribution.error_summary`` of the
        sites (the worst site's gap and bound)."""
        n = len(self.sites)
        return f"{self.sites.error_summary()} over {n} site{'s' if n != 1 else ''}"

    def __repr__(self) -> str:
        """One short line whatever the number of prompts and positions."""
        n, s = len(self), self.sites
        what = f"direction read by {s.read_by}" if s.read_by else f"target {token_summary(s.target_tokens or ('',))}"
        if s.contrast_tokens:
            what += f" - {token_summary(s.contrast_tokens)}"
        prompt = f", prompt {short(str(self.prompts[0]), 40)}" if n == 1 and self.prompts else ""
        return (f"PositionAttribution({s.family}, by={s.by!r}, {n} prompt{'s' if n != 1 else ''} x "
                f"{self.n_positions} position{'s' if self.n_positions != 1 else ''} x {len(s.labels)} components"
                f"{prompt}, {what}, {self.error_summary()})")
