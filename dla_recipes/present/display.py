"""Showing a figure of ``plots`` wherever it is looked at: a notebook, the docs site, a script.

``show(fig)`` returns a ``PlotDisplay``: a notebook output carrying plotly's own JSON (JupyterLab, VS Code), an HTML
div drawn with the page's plotly.js (the docs site loads it once), and a PNG (``static_png``, drawn with matplotlib)
that stays in place wherever plotly.js does not run. Outside a notebook (a script, the terminal IPython), where
nothing displays what ``show`` returns, it writes a standalone HTML page and prints its path.
"""

from __future__ import annotations

import base64
import html
import io
import json
import sys
import tempfile
import uuid
from pathlib import Path

BAR = "#1f77b4"  # a bar trace's colour when the figure gives none


def static_png(fig, width: int = 900) -> bytes | None:
    """A PNG of a figure made by this module (bars and heatmaps), drawn with matplotlib; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import numpy as np

    layout = fig.layout
    meta = layout.meta if isinstance(layout.meta, dict) else {}
    height = int(layout.height or 420)
    w = int(layout.width or meta.get("static_width") or width)
    figure, ax = plt.subplots(figsize=(w / 100, height / 100), dpi=100)
    columns: dict = {}  # vertical bars of all traces, drawn together in the x axis' category order
    for trace in fig.data:
        if trace.type == "heatmap":
            z = np.array([[np.nan if v is None else v for v in row] for row in trace.z], dtype=float)
            bound = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
            image = ax.imshow(z, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
            ax.set_xticks(range(len(trace.x)), list(trace.x), fontsize=7)
            ax.set_yticks(range(len(trace.y)), list(trace.y), fontsize=7)
            ax.xaxis.tick_top()
            label = trace.colorbar.title.text if trace.colorbar and trace.colorbar.title else None
            figure.colorbar(image, ax=ax, label=label or "")
        elif trace.type == "bar" and trace.orientation == "h":
            ax.barh(list(trace.y), list(trace.x), color=trace.marker.color or BAR)
            ax.invert_yaxis()
            ax.axvline(0, color="black", linewidth=0.6)
        elif trace.type == "bar":
            spread = trace.error_y.array if trace.error_y and trace.error_y.array is not None else [None] * len(trace.x)
            for x, y, e in zip(trace.x, trace.y, spread):
                columns[x] = (y, trace.marker.color or BAR, trace.name, e)
    if columns:
        order = list(layout.xaxis.categoryarray or columns)
        order = [x for x in order if x in columns] + [x for x in columns if x not in order]
        errors = [columns[x][3] for x in order]
        ax.bar(range(len(order)), [columns[x][0] for x in order], color=[columns[x][1] for x in order],
               yerr=None if all(e is None for e in errors) else [e or 0.0 for e in errors], error_kw={"linewidth": 0.6})
        ax.set_xticks(range(len(order)), order, rotation=90, fontsize=6 if len(order) > 20 else 8)
        ax.set_xlim(-0.6, len(order) - 0.4)
        ax.axhline(0, color="black", linewidth=0.6)
        names = dict.fromkeys((columns[x][2], columns[x][1]) for x in order)
        if len(names) > 1:
            from matplotlib.patches import Patch

            ax.legend(handles=[Patch(color=c, label=n) for n, c in names], fontsize=7)
    if layout.yaxis.title and layout.yaxis.title.text and not any(t.type == "heatmap" for t in fig.data):
        ax.set_ylabel(layout.yaxis.title.text, fontsize=8)
    title = layout.title.text if layout.title and layout.title.text else ""
    ax.set_title(title, fontsize=9)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


class PlotDisplay:
    """What ``show`` returns: a notebook output with plotly JSON, an HTML div (+ PNG fallback) and a PNG."""

    def __init__(self, fig, div_id: str | None = None, static: bool = True):
        self.fig = fig
        meta = fig.layout.meta if isinstance(fig.layout.meta, dict) else {}
        self.kind = meta.get("dla_plot", "figure")
        self.div_id = div_id or f"dla-{self.kind.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
        self.png = static_png(fig) if static else None
        self.path: Path | None = None  # the HTML file ``write`` wrote, if any

    def html(self) -> str:
        """A div drawn by the page's plotly.js (``window.Plotly``); the static PNG stays where there is none."""
        spec = self.fig.to_json().replace("</", "<\\/")
        title = self.fig.layout.title.text if self.fig.layout.title and self.fig.layout.title.text else self.kind
        image = ""
        if self.png is not None:
            data = base64.b64encode(self.png).decode()
            image = f'<img class="dla-plot-static" alt="{html.escape(title)}" src="data:image/png;base64,{data}">'
        div_id = html.escape(self.div_id)
        return (
            f'<div class="dla-plot" data-dla-plot="{html.escape(self.kind)}">{image}'
            f'<div id="{div_id}" class="dla-plotly" style="display:none"></div>'
            "<script>(function () {"
            f"var spec = {spec}; var id = {json.dumps(self.div_id)};"
            "function draw() { var div = document.getElementById(id);"
            " if (!window.Plotly || !div || div.dataset.drawn) return; div.dataset.drawn = '1'; div.style.display = '';"
            " Plotly.newPlot(div, spec.data, spec.layout, {responsive: true, displaylogo: false, displayModeBar: 'hover'});"
            " var img = div.parentNode.querySelector('.dla-plot-static'); if (img) img.remove(); }"
            "if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', draw); else draw();"
            "})();</script></div>"
        )

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = {
            "application/vnd.plotly.v1+json": json.loads(self.fig.to_json()),
            "text/html": self.html(),
            "text/plain": f"<{self.kind} figure: {self.fig.layout.title.text or ''}>",
        }
        if self.png is not None:
            bundle["image/png"] = base64.b64encode(self.png).decode()
        return bundle


    def page(self) -> str:
        """A standalone HTML page of the figure: drawn by plotly.js from its CDN where the browser is online, the
        static PNG where it is not."""
        from plotly.offline import get_plotlyjs_version

        title = html.escape(self.fig.layout.title.text or self.kind)
        script = f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"
        return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title>'
                f'<script src="{script}"></script></head>\n<body>{self.html()}</body></html>\n')

    def write(self, path) -> Path:
        """Write ``page()`` to ``path`` (parent folders made); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.page(), encoding="utf-8")
        self.path = path
        return path


def in_notebook() -> bool:
    """Whether a Jupyter kernel will display what a cell returns (not a script, not the terminal IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return getattr(shell, "kernel", None) is not None


def show(fig, div_id: str | None = None, static: bool = True, path=None) -> PlotDisplay:
    """Display a figure in a notebook so it renders everywhere; ``div_id`` names the HTML element (default: unique).

    JupyterLab and VS Code draw plotly's JSON; a page that loads plotly.js (the docs site) draws the HTML div;
    anything else shows the static PNG (``static=False`` leaves it out). A notebook displays what ``show`` returns
    (the last line of a cell), as for any object.

    Outside a notebook (a script, the terminal IPython) nothing could display it, so ``show`` writes a standalone
    HTML page (``PlotDisplay.page``) to ``path``, default a new file in ``tempfile.gettempdir()/dla_recipes_plots/``,
    and prints where on stderr. ``path`` given: the page is written there in a notebook too. The returned
    ``PlotDisplay`` has the file in ``.path`` (None when none was written).
    """
    display = PlotDisplay(fig, div_id=div_id, static=static)
    if path is None and not in_notebook():
        path = Path(tempfile.gettempdir()) / "dla_recipes_plots" / f"{display.div_id}.html"
        display.write(path)
        print(f"plots.show: no notebook to draw in, so the figure is written to {path} (open it in a browser)",
              file=sys.stderr, flush=True)
    elif path is not None:
        display.write(path)
    return display
