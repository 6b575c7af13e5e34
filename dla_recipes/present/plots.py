"""Plots of an ``Attribution`` for notebooks and the docs: a per-block bar chart, a layer x head heatmap, top-k views.

plotly (figures), matplotlib (the static fallback of ``show``) and jinja2 (pandas' table styling) are optional: they
are imported inside the functions, so ``import dla_recipes`` never needs them; ``pip install "dla_recipes[plots]"``
brings all three, and a figure function without plotly raises an ImportError that says so.

    from dla_recipes import plots
    plots.blocks_bar(attr)            # contributions per block term (embed, L0.attn, L0.mlp, ...), forward order
    plots.heads_heatmap(attr)         # layers x heads (an attribution by="head")
    plots.sources_heatmap(attr, toks) # the strongest heads x the source tokens they read (by="source")
    plots.top_bar(attr, k=20)         # the k largest components (heads, neurons, experts, blocks)
    plots.top_table(attr, k=10)       # the same as a table with bars (a pandas Styler)
    plots.stats_bars(stats, k=20)     # an AttributionStats (reduce="stats"): the k largest means, t intervals
    plots.positions_heatmap(pattr)    # a PositionAttribution: blocks x one prompt's positions (position_plots)
    plots.token_text(pattr, "L5.attn")  # ... its text, each token coloured by that part (HTML)
    plots.show(fig)                   # display: interactive where plotly.js runs, a static PNG where it cannot;
                                      # in a script: an HTML file (its path printed)

Each figure function returns a ``plotly.graph_objects.Figure``; ``fig.show()`` works as usual in Jupyter. ``show``
is what the docs use: one output carrying plotly's own JSON (JupyterLab, VS Code), an HTML div drawn with the page's
plotly.js (the docs site loads it once), and a PNG that stays in place wherever plotly.js does not run; in a script
it writes an HTML page (``present.display``). ``prompt=None`` in any figure function: the mean over the prompts.
"""

from __future__ import annotations

import math

import torch

from .display import PlotDisplay, in_notebook, show, static_png
from .position_plots import TokenText, positions_heatmap, token_text, top_components_heatmap

__all__ = ["PlotDisplay", "TokenText", "block_values", "blocks_bar", "heads_heatmap", "in_notebook",
           "positions_heatmap", "show", "source_matrix", "sources_heatmap", "static_png", "stats_bars", "token_text",
           "top_bar", "top_components_heatmap", "top_table"]

_COLORS = {"embed": "#7f7f7f", "attn": "#1f77b4", "mlp": "#ff7f0e", "experts": "#d62728", "mixer": "#2ca02c",
           "ple": "#9467bd"}
_OTHER = "#8c564b"


_INSTALL = 'pip install "dla_recipes[plots]"  (or: pip install plotly matplotlib jinja2)'


def _plotly():
    """``plotly.graph_objects``, or an ImportError that says how to get it."""
    try:
        import plotly.graph_objects as go
    except ImportError as error:
        raise ImportError(f"dla_recipes.plots draws with plotly, which is not installed: {_INSTALL}") from error
    return go


def _title(attr, prompt: int | None, what: str, quantity: str | None = None) -> str:
    """``what: quantity = value``; ``quantity`` defaults to the attributed logit (difference). ``prompt=None``:
    ``what: mean quantity over N prompts = value``."""
    if quantity is None:
        def token(tokens, name: str) -> str:  # the prompt's token, or the one token of all prompts, else its name
            distinct = set(tokens) if prompt is None else {tokens[prompt]}
            return repr(distinct.pop()) if len(distinct) == 1 else name

        quantity = f"logit({token(attr.target_tokens, 'target') if attr.target_tokens else 'target'})"
        if attr.contrast_tokens:
            quantity += f" - logit({token(attr.contrast_tokens, 'contrast')})"
    if prompt is None:
        return f"{what}: mean {quantity} over {len(attr)} prompts = {float(attr.logit.mean()):.3f}"
    return f"{what}: {quantity} = {float(attr.logit[prompt]):.3f}"


def _check_prompt(attr, prompt: int | None) -> int | None:
    """``prompt`` as a row index, or None (the mean over the prompts)."""
    if prompt is None:
        return None
    if not -len(attr) <= prompt < len(attr):
        raise IndexError(f"prompt {prompt} is outside this attribution of {len(attr)} prompts")
    return prompt % len(attr)


def _row(values: torch.Tensor, prompt: int | None) -> torch.Tensor:
    """``values[prompt]``, or the mean over the prompts (dim 0) for ``prompt=None``."""
    return values.mean(0) if prompt is None else values[prompt]


def block_values(attr, prompt: int | None = 0):
    """A pandas Series: the contributions per block term (``embed``, ``L0.attn``, ``L0.mlp``, ...) of one prompt
    (``prompt=None``: the mean over the prompts).

    At head / neuron / expert granularity the parts are summed into their block (``Attribution.blocks()``), so the
    Series is the one an attribution ``by="block"`` gives, up to float rounding.
    """
    import pandas as pd

    prompt = _check_prompt(attr, prompt)
    blocks = attr.blocks() if attr.by != "block" else attr
    return pd.Series(_row(blocks.values, prompt).double().numpy(), index=pd.Index(blocks.labels, name="component"),
                     name="value")


def blocks_bar(attr, prompt: int | None = 0, quantity: str | None = None):
    """A bar per block term, in forward order, coloured by kind (attention, MLP, mixer, experts, embedding).

    Works at any granularity (parts are summed into their block, see ``block_values``). The title holds the logit
    the bars and the constant sum to. ``prompt=None`` (here and in every figure function): the mean over the
    prompts, and the mean logit.
    """
    go = _plotly()

    prompt = _check_prompt(attr, prompt)
    series = block_values(attr, prompt)
    blocks = attr.blocks() if attr.by != "block" else attr
    term_of = {label: component.term for label, component in zip(blocks.labels, blocks.components)}
    logit = float(_row(attr.logit, prompt))
    fig = go.Figure()
    kinds = dict.fromkeys(term_of[label] for label in series.index)
    for kind in kinds:
        chosen = [label for label in series.index if term_of[label] == kind]
        fig.add_bar(
            x=chosen, y=series[chosen].tolist(), name=kind, marker_color=_COLORS.get(kind, _OTHER),
            customdata=[[v / logit if logit else float("nan")] for v in series[chosen]],
            hovertemplate="%{x}: %{y:.4f} (%{customdata[0]:.1%} of the total)<extra></extra>",
        )
    fig.update_layout(
        title=dict(text=_title(attr, prompt, f"Attribution by block ({attr.family})", quantity), x=0.01, xanchor="left"),
        xaxis=dict(title="component (forward order)", categoryorder="array", categoryarray=list(series.index),
                   tickangle=-60, tickfont=dict(size=9)),
        yaxis=dict(title="contribution to the logit" if quantity is None else "contribution", zeroline=True),
        barmode="relative", template="plotly_white", height=420, legend_title_text="term",
        margin=dict(l=60, r=20, t=80, b=90), meta={"dla_plot": "blocks_bar"},
    )
    return fig


TITLE_SPACE = 62  # px at the top for the title: below the hover toolbar (26 px), one line of plotly_white's 17 px font
AXIS_TITLE_SPACE = 28  # px for a top x axis's title and its standoff


def _top_axis_layout(text: str, labels, tickangle: float = 0.0) -> dict:
    """The title and top margin of a heatmap whose x axis (tick labels, then the axis title) is on top: the title is
    pinned to the figure's top and the margin leaves room for it above the axis title and the tick labels, so
    neither overlaps it (a title placed by plotly in the middle of the margin sat on the axis title). The tick
    labels' height is estimated from the longest label (12 px Arial: about 6.6 px a character, rotated by
    ``tickangle``); the axis's ``automargin`` still grows the margin should a label be taller."""
    longest = max((len(str(label)) for label in labels), default=1)
    angle = math.radians(abs(tickangle))
    ticks = 6.6 * longest * math.sin(angle) + 12 * math.cos(angle) + 8
    return dict(title=dict(text=text, x=0.01, xanchor="left", y=1, yref="container", yanchor="top", pad=dict(t=28)),
                margin_top=int(TITLE_SPACE + AXIS_TITLE_SPACE + ticks))


def heads_heatmap(attr, prompt: int | None = 0, quantity: str | None = None):
    """A layers x heads heatmap of the heads' contributions (an attribution ``by="head"``), diverging at 0.

    Layer 0 is at the top; a cell with no head (a block without attention) is left blank. ``quantity`` names
    what the parts sum to in the title (default: the attributed logit, e.g. ``"logit(' Paris')"``); the same
    argument exists on every figure function here.
    """
    go = _plotly()

    prompt = _check_prompt(attr, prompt)
    grid = _row(attr.grid("H"), prompt)  # [layers, heads], NaN where absent
    z = [[None if math.isnan(v) else round(float(v), 6) for v in row] for row in grid.tolist()]
    bound = float(torch.nan_to_num(grid.abs(), nan=0.0).max()) or 1.0
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"H{h}" for h in range(grid.shape[1])], y=[f"L{i}" for i in range(grid.shape[0])],
        colorscale="RdBu", reversescale=True, zmid=0.0, zmin=-bound, zmax=bound,
        colorbar=dict(title=dict(text="logit" if quantity is None else "")), hoverongaps=False,
        hovertemplate="%{y}.%{x}: %{z:.4f}<extra></extra>",
    ))
    columns = [f"H{h}" for h in range(grid.shape[1])]
    top = _top_axis_layout(_title(attr, prompt, f"Heads ({attr.family})", quantity), columns)
    fig.update_layout(
        title=top["title"],
        xaxis=dict(title="head", side="top", automargin=True), yaxis=dict(title="layer", autorange="reversed"),
        template="plotly_white", height=max(320, 22 * grid.shape[0] + 130),
        margin=dict(l=60, r=20, t=top["margin_top"], b=30),
        meta={"dla_plot": "heads_heatmap", "static_width": max(420, 60 * grid.shape[1] + 220)},
    )
    return fig


def source_matrix(attr, prompt: int | None = 0, k: int = 10):
    """``(rows, matrix [k, sources])`` of a ``by="source"`` attribution: the ``k`` heads with the largest total
    ``|part|`` and their parts per own source position; ``prompt=None`` averages over the prompts (by own
    position: meaningful for prompts of one template with the same token count)."""
    grid = attr.sources()  # [batch, layers, heads, sources], NaN for heads not split
    grid = grid.mean(0) if prompt is None else grid[_check_prompt(attr, prompt)]
    flat = grid.flatten(0, 1)  # [layers * heads, sources]
    weight = torch.nan_to_num(flat.abs(), nan=0.0).sum(-1)
    order = torch.argsort(weight, descending=True)[: min(k, int((weight > 0).sum()) or 1)]
    heads = grid.shape[1]
    return [f"L{int(j) // heads}.H{int(j) % heads}" for j in order], flat[order]


def sources_heatmap(attr, tokens, prompt: int | None = 0, k: int = 10, quantity: str | None = None):
    """A heads x source-tokens heatmap of a ``by="source"`` attribution: which token each of the ``k`` strongest
    heads read its part of the logit from. ``tokens``: the prompt's own tokens (the column labels, ``S0`` first);
    ``prompt=None`` averages over the prompts (see ``source_matrix``)."""
    import plotly.graph_objects as go

    rows, matrix = source_matrix(attr, prompt, k)
    n = min(len(tokens), matrix.shape[1])
    matrix = matrix[:, :n]
    columns = [f"{s}: {tok!r}" for s, tok in enumerate(tokens[:n])]
    bound = float(torch.nan_to_num(matrix.abs(), nan=0.0).max()) or 1.0
    fig = go.Figure(go.Heatmap(
        z=[[round(float(v), 6) for v in row] for row in matrix.tolist()], x=columns, y=rows,
        colorscale="RdBu", reversescale=True, zmid=0.0, zmin=-bound, zmax=bound,
        colorbar=dict(title=dict(text="logit" if quantity is None else "")),
        hovertemplate="%{y} reading %{x}: %{z:.4f}<extra></extra>",
    ))
    what = f"Heads by source token ({attr.family})"
    title = _title(attr, None if prompt is None else _check_prompt(attr, prompt), what, quantity)
    top = _top_axis_layout(title, columns, tickangle=-45)
    fig.update_layout(
        title=top["title"],
        xaxis=dict(title="source token", side="top", tickangle=-45, automargin=True),
        yaxis=dict(title="head", autorange="reversed"),
        template="plotly_white", height=max(320, 26 * len(rows) + top["margin_top"] + 40),
        margin=dict(l=80, r=20, t=top["margin_top"], b=30),
        meta={"dla_plot": "sources_heatmap", "static_width": max(520, 70 * n + 240)},
    )
    return fig


def top_bar(attr, k: int = 20, prompt: int | None = 0, quantity: str | None = None, kind: str | None = None):
    """Horizontal bars of the ``k`` largest components by absolute value (largest at the top); ``kind``: only
    heads, neurons, ... (``Attribution.top``)."""
    go = _plotly()

    prompt = _check_prompt(attr, prompt)
    top = attr.top(k, prompt, kind=kind)
    colors = ["#d62728" if v < 0 else "#1f77b4" for v in top["value"]]
    fig = go.Figure(go.Bar(
        x=top["value"].tolist(), y=top["component"].tolist(), orientation="h", marker_color=colors,
        customdata=[[s] for s in top["share"]],
        hovertemplate="%{y}: %{x:.4f} (%{customdata[0]:.1%} of the total)<extra></extra>",
    ))
    fig.update_layout(
        title=dict(text=_title(attr, prompt, f"Top {len(top)} by {attr.by} ({attr.family})", quantity), x=0.01,
                   xanchor="left"),
        xaxis=dict(title="contribution to the logit" if quantity is None else "contribution", zeroline=True),
        yaxis=dict(autorange="reversed"),
        template="plotly_white", height=max(300, 22 * len(top) + 130), margin=dict(l=90, r=20, t=80, b=50),
        meta={"dla_plot": "top_bar"},
    )
    return fig


def stats_bars(stats, k: int = 20, ci: float = 0.95, interval: str = "t"):
    """Horizontal bars of an ``AttributionStats``' ``k`` components with the largest ``|mean|`` (largest at the
    top), with error bars: the t interval at ``ci`` (``interval="t"``) or the bootstrap one (``"bootstrap"``)."""
    go = _plotly()

    if interval not in ("t", "bootstrap"):
        raise ValueError(f"interval={interval!r}: 't' or 'bootstrap'")
    top = stats.top(k, ci)
    low, high = ("ci_low", "ci_high") if interval == "t" else ("boot_low", "boot_high")
    mean = top["mean"]
    fig = go.Figure(go.Bar(
        x=mean.tolist(), y=top.index.tolist(), orientation="h",
        marker_color=["#d62728" if v < 0 else "#1f77b4" for v in mean],
        error_x=dict(type="data", symmetric=False, array=(top[high] - mean).tolist(),
                     arrayminus=(mean - top[low]).tolist(), color="#444"),
        customdata=top[[low, high, "p_signflip"]].to_numpy().tolist(),
        hovertemplate="%{y}: %{x:.4f} [%{customdata[0]:.4f}, %{customdata[1]:.4f}], sign-flip p = "
                      "%{customdata[2]:.3g}<extra></extra>",
    ))
    what = "paired difference" if stats.paired else "mean"
    fig.update_layout(
        title=dict(text=f"Top {len(top)} by {stats.by} ({stats.family}): {what} over {stats.n} samples, "
                        f"{ci:.0%} {'t' if interval == 't' else 'bootstrap'} interval", x=0.01, xanchor="left"),
        xaxis=dict(title=f"{what} contribution to the logit", zeroline=True), yaxis=dict(autorange="reversed"),
        template="plotly_white", height=max(300, 22 * len(top) + 130), margin=dict(l=90, r=20, t=80, b=50),
        meta={"dla_plot": "stats_bars"},
    )
    return fig


def top_table(attr, k: int = 10, prompt: int | None = 0, quantity: str | None = None, kind: str | None = None):
    """The ``k`` largest components as a pandas ``Styler``: signed values, shares, and bars centred at 0
    (``kind``: only heads, neurons, ..., as in ``Attribution.top``).

    The bars sit in a last, unlabelled column of their own (negative to the left, positive to the right), clear of
    the numbers. The HTML table carries the class ``dla-top-table``.
    """
    prompt = _check_prompt(attr, prompt)
    try:
        import jinja2  # noqa: F401  (pandas' Styler renders with it)
    except ImportError as error:
        raise ImportError(f"dla_recipes.plots.top_table styles a pandas table, which needs jinja2: {_INSTALL}") from error
    top = attr.top(k, prompt, kind=kind)
    top[""] = top["value"]  # the bars get a column of their own, so a long negative bar never covers a number
    return (
        top.style.format({"value": "{:+.4f}", "share": "{:+.1%}", "": lambda _: ""})
        .bar(subset=[""], align="zero", color=["#f4a6a6", "#9ecae1"], width=100, height=70)
        .set_properties(subset=[""], **{"min-width": "9em"})
        .hide(axis="index")
        .set_table_attributes('class="dla-top-table"')
        .set_caption(_title(attr, prompt, f"Top {len(top)} by {attr.by}", quantity))
    )
