"""Plots of a ``PositionAttribution`` (several positions a prompt), re-exported by ``plots``: one prompt's positions.

    plots.positions_heatmap(attr, prompt=0)              # blocks (y) x the prompt's positions (x: token -> target)
    plots.top_components_heatmap(attr, k=12, kind="head")  # its k largest heads (y) x the prompt's positions
    plots.token_text(attr, component="L5.attn")          # the prompt's text, each token coloured by that part

``positions_heatmap`` returns a ``plotly.graph_objects.Figure`` (plotly imported inside it, as in ``plots``: ``pip
install "dla_recipes[plots]"``); ``token_text`` needs nothing but the standard library: it returns a ``TokenText``,
which a notebook shows as HTML (``_repr_html_``) and ``.html`` holds as a string. Colours diverge at 0 as in
``plots.heads_heatmap``: red for a part that raises the logit, blue for one that lowers it.
"""

from __future__ import annotations

import html
import math
from typing import NamedTuple

import torch

from ..errors import InputError
from .attribution import KINDS, row_index, short

INSTALL = 'pip install "dla_recipes[plots]"  (or: pip install plotly matplotlib jinja2)'
RAISE, LOWER = (178, 24, 43), (33, 102, 172)  # RdBu's ends: the colour of a positive part, of a negative part


def plotly():
    """``plotly.graph_objects``, or an ImportError that says how to get it."""
    try:
        import plotly.graph_objects as go
    except ImportError as error:
        raise ImportError(f"dla_recipes.plots draws with plotly, which is not installed: {INSTALL}") from error
    return go


def prompt_sites(attr, prompt: int) -> tuple[int, list[int], list[int]]:
    """``(prompt row, its sites' rows in ``attr.sites``, their own positions)``, in column order."""
    b = row_index(prompt, len(attr))[0]
    rows = attr.index[b][attr.index[b] >= 0].tolist()
    return b, rows, [int(attr.sites.positions[r]) for r in rows]


def token_at(attr, b: int, position: int) -> str:
    """Prompt ``b``'s own token at ``position`` (``"[3]"`` where ``attr`` keeps no tokens)."""
    own = attr.tokens[b] if attr.tokens else ()
    return own[position] if 0 <= position < len(own) else f"[{position}]"


def heading(attr, b: int, what: str, quantity: str | None, count: int) -> str:
    """``what: logit('w20') at 6 positions of prompt 0 'w5 w6 ...'`` (``quantity`` replaces the logit's name)."""
    if quantity is None:
        rows = attr.index[b][attr.index[b] >= 0].tolist()
        targets = {attr.sites.target_tokens[r] for r in rows} if attr.sites.target_tokens else set()
        quantity = f"logit({repr(targets.pop()) if len(targets) == 1 else 'target'})"
        contrasts = {attr.sites.contrast_tokens[r] for r in rows} if attr.sites.contrast_tokens else set()
        if contrasts:
            quantity += f" - logit({repr(contrasts.pop()) if len(contrasts) == 1 else 'contrast'})"
    prompt = f" {short(str(attr.prompts[b]), 40)}" if attr.prompts else ""
    return f"{what}: {quantity} at {count} position{'s' * (count != 1)} of prompt {b}{prompt}"


def positions_heatmap(attr, prompt: int = 0, quantity: str | None = None):
    """A blocks x positions heatmap of one prompt: each block term's part (``embed``, ``L0.attn``, ``L0.mlp``, ...,
    forward order from the top; heads / neurons / experts summed into their block, ``blocks()``) of the logit at
    each attributed position (x: the position, its token and the target token predicted there), diverging at 0.
    Masked positions (the prompt is shorter) are left out."""
    where = b, rows, _ = prompt_sites(attr, prompt)
    blocks = attr.blocks() if attr.by != "block" else attr
    z = blocks.sites.values[rows].T if rows else torch.zeros(len(blocks.labels), 0)  # [n_blocks, n_positions]
    title = heading(attr, b, f"Blocks by position ({attr.family})", quantity, len(rows))
    return _heatmap(attr, where, list(blocks.labels), z,
                    Captions(title, quantity, "positions_heatmap", "component (forward order)"))


def top_components_heatmap(attr, k: int = 12, prompt: int = 0, kind: str | None = None, quantity: str | None = None):
    """The ``k`` components (``kind``: ``"head"``, ``"neuron"``, ... only) with the largest ``|part|`` summed over
    one prompt's attributed positions (y, largest first) x those positions (x: token -> target), diverging at 0:
    e.g. an answer's tokens x its top heads (``attribute_generation(..., by="head")``)."""
    where = b, rows, _ = prompt_sites(attr, prompt)
    if kind is not None and kind not in KINDS:
        raise InputError(f"kind={kind!r}: use one of {', '.join(map(repr, KINDS))}, or None for all")
    columns = [i for i, c in enumerate(attr.components) if kind is None or KINDS[kind](c)]
    if not columns:
        raise InputError(f"kind={kind!r}: no component of this attribution is of that kind")
    values = attr.sites.values[rows][:, columns] if rows else torch.zeros(0, len(columns))  # [n_positions, n]
    order = values.abs().sum(0).argsort(descending=True)[:k].tolist()
    z = values[:, order].T  # [k, n_positions]
    title = heading(attr, b, f"Top {len(order)} {kind or 'component'}s by position ({attr.family})", quantity,
                    len(rows))
    return _heatmap(attr, where, [attr.labels[columns[i]] for i in order], z,
                    Captions(title, quantity, "top_components_heatmap", "component (largest |part| first)"))


class Captions(NamedTuple):
    """A heatmap's words: its ``title``, the ``quantity`` plotted (None: the logit), the plot's ``name`` (its
    ``dla_plot`` meta) and the y axis' title."""

    title: str
    quantity: str | None
    name: str
    ytitle: str


def _heatmap(attr, where: tuple, labels: list, z: torch.Tensor, captions: Captions):
    """The figure of ``z`` ``[len(labels), len(rows)]``: rows ``labels`` x the prompt's sites (``where``:
    ``prompt_sites``' ``(b, rows, positions)``)."""
    b, rows, positions = where
    title, quantity, name, ytitle = captions
    go = plotly()
    targets = [attr.sites.target_tokens[r] if attr.sites.target_tokens else "" for r in rows]
    columns = [f"{p}: {token_at(attr, b, p)!r}<br>→ {t!r}" for p, t in zip(positions, targets)]
    hover = [[f"{label} at {p} {token_at(attr, b, p)!r} (target {t!r})" for p, t in zip(positions, targets)]
             for label in labels]
    bound = float(z.abs().max()) if z.numel() else 0.0
    fig = go.Figure(go.Heatmap(
        z=[[round(float(v), 6) for v in row] for row in z.tolist()], x=columns, y=labels,
        customdata=hover, colorscale="RdBu", reversescale=True, zmid=0.0, zmin=-(bound or 1.0), zmax=bound or 1.0,
        colorbar=dict(title=dict(text="logit" if quantity is None else "")),
        hovertemplate="%{customdata}: %{z:.4f}<extra></extra>",
    ))
    fig.update_layout(
        title=dict(text=title, x=0.01, xanchor="left"),
        xaxis=dict(title="position: token → target", categoryorder="array", categoryarray=columns, tickangle=-45,
                   tickfont=dict(size=10), automargin=True),
        yaxis=dict(title=ytitle, autorange="reversed", automargin=True),
        template="plotly_white", height=max(340, 20 * len(labels) + 200),
        margin=dict(l=80, r=20, t=80, b=100),
        meta={"dla_plot": name, "static_width": max(520, 56 * len(rows) + 260)},
    )
    return fig


class TokenText:
    """A prompt's text with each token coloured by one component's part: ``_repr_html_`` for a notebook, ``html``
    the markup, ``values`` ``[n_tokens]`` the part at each of the prompt's own positions (NaN: not attributed)."""

    def __init__(self, markup: str, values: torch.Tensor, title: str):
        self.html, self.values, self.title = markup, values, title

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return f"TokenText({self.title})"


def component_values(attr, component: str) -> torch.Tensor:
    """``[n_sites]``: ``component``'s part at every site. A block label (``"L5.attn"``) is the whole block at any
    granularity (``blocks()``); a part's label (``"L5.H3"``) that part; ``"constant"`` and ``"logit"`` those."""
    sites = attr.sites
    if component in ("constant", "logit"):
        return getattr(sites, component)
    blocks = sites.blocks() if sites.by != "block" else sites
    if component in blocks.labels:
        return blocks.values[:, blocks.labels.index(component)]
    if component in sites.labels:
        return sites.values[:, sites.labels.index(component)]
    near = ", ".join(blocks.labels[:6])
    raise InputError(f"component={component!r} is not one of this attribution's (by={sites.by!r}) components: "
                     f"a block label ({near}, ...), a part's label from attr.labels, 'constant' or 'logit'")


def colour(value: float, bound: float) -> str:
    """A CSS background: red for a positive part, blue for a negative one, as opaque as ``|value| / bound``."""
    if math.isnan(value) or bound <= 0:
        return "transparent"
    r, g, b = RAISE if value > 0 else LOWER
    return f"rgba({r}, {g}, {b}, {min(1.0, abs(value) / bound) * 0.85:.3f})"


def token_text(attr, component: str = "L0.attn", prompt: int = 0) -> TokenText:
    """One prompt's tokens as HTML text, each attributed token's background coloured by ``component``'s part of
    the logit at that position (diverging at 0, scaled to the prompt's largest ``|part|``; tokens not attributed
    are left plain), with a tooltip giving the value, the position and the target. ``component``: a block label
    (the whole block at any granularity), a part's label, ``"constant"`` or ``"logit"``."""
    b, rows, positions = prompt_sites(attr, prompt)
    per_site = component_values(attr, component)
    n_tokens = len(attr.tokens[b]) if attr.tokens else max(positions, default=-1) + 1
    values = torch.full((n_tokens,), float("nan"))
    targets = {}
    for r, p in zip(rows, positions):
        if 0 <= p < n_tokens:
            values[p] = float(per_site[r])
            targets[p] = attr.sites.target_tokens[r] if attr.sites.target_tokens else ""
    bound = float(torch.nan_to_num(values.abs(), nan=0.0).max()) if n_tokens else 0.0
    spans = []
    for p in range(n_tokens):
        token, value = token_at(attr, b, p), float(values[p])
        tip = (f"position {p} {token!r}: not attributed" if math.isnan(value) else
               f"position {p} {token!r} (target {targets[p]!r}): {component} = {value:+.4f}")
        spans.append(f'<span title="{html.escape(tip)}" style="background: {colour(value, bound)}; '
                     f'white-space: pre-wrap; border-radius: 3px; padding: 1px 0">{html.escape(token)}</span>')
    title = heading(attr, b, f"{component} by token ({attr.family})", None, len(rows))
    markup = (f'<div class="dla-token-text" data-dla-plot="token_text"><div style="font-size: 0.9em; margin-bottom: '
              f'4px">{html.escape(title)}; red raises it, blue lowers it (max |part| {bound:.4f})</div>'
              f'<div style="font-family: monospace; line-height: 1.9">{"".join(spans)}</div></div>')
    return TokenText(markup, values, title)
