"""``ScoreAttribution``: why a head attended, one query x key component matrix per (prompt, key).

``attribute_scores`` returns one: ``values [batch, keys, query components, key components]`` (pair ``(i, j)`` is
``q_i . k_j * scaling``), ``constant [batch, keys]`` (the terms of no pair: biases, and each side's component times
the other side's biases), ``score [batch, keys]`` (the model's own pre-softmax score; ``values.sum((-2, -1)) +
constant == score``), the labels of both sides, and each prompt's own key positions. ``to_frame()`` is the long form,
``top(k)`` the largest pairs, ``heatmap()`` a plotly figure of one matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ScoreAttribution:
    """One head's pre-softmax scores split into query x key component pairs.

    Attributes:
        values: ``[batch, keys, query components, key components]``.
        constant, score, error: ``[batch, keys]`` (``error``: ``|values.sum + constant - score|``).
        query_labels, key_labels: the components of each side (``embed``, ``L0.attn``, ``L3.H5``, ...).
        keys: each prompt's own key positions (``[batch][keys]``); ``queries``: each prompt's own query position.
        head: the head's label; ``prompts``: the prompts as text; ``softcap``: the attention soft-cap the model
            applies to ``score`` before its softmax (None: none); ``diagnostics``: the rebuild gaps and fit errors.
    """

    values: torch.Tensor
    constant: torch.Tensor
    score: torch.Tensor
    query_labels: tuple[str, ...]
    key_labels: tuple[str, ...]
    keys: tuple[tuple[int, ...], ...]
    queries: tuple[int, ...]
    head: str
    prompts: tuple[str, ...] = ()
    softcap: float | None = None
    error: torch.Tensor | None = None
    diagnostics: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def to_frame(self):
        """A long pandas DataFrame: ``prompt``, ``key`` (the prompt's own position), ``query_component``,
        ``key_component``, ``value``, one row per pair."""
        import pandas as pd

        batch, n_keys, nq, nk = self.values.shape
        records = []
        flat = self.values.reshape(batch, n_keys, -1).tolist()
        for b in range(batch):
            for k in range(n_keys):
                row = flat[b][k]
                for i in range(nq):
                    for j in range(nk):
                        records.append((b, self.keys[b][k], self.query_labels[i], self.key_labels[j], row[i * nk + j]))
        return pd.DataFrame(records, columns=["prompt", "key", "query_component", "key_component", "value"])

    def top(self, k: int = 10, prompt: int = 0, key: int = 0, by_abs: bool = True):
        """The ``k`` largest pairs of one prompt's ``key``-th key (an index into ``keys[prompt]``), as a DataFrame
        (``query_component``, ``key_component``, ``value``, ``share`` of the score)."""
        import pandas as pd

        matrix = self.values[prompt, key]
        flat = matrix.reshape(-1)
        order = torch.argsort(flat.abs() if by_abs else flat, descending=True)[:k].tolist()
        nk = matrix.shape[1]
        score = float(self.score[prompt, key])
        rows = [(self.query_labels[i // nk], self.key_labels[i % nk], float(flat[i]),
                 float(flat[i]) / score if score else float("nan")) for i in order]
        return pd.DataFrame(rows, columns=["query_component", "key_component", "value", "share"])

    def difference(self, prompt: int = 0, first: int = 0, second: int = 1) -> torch.Tensor:
        """``[query components, key components]``: the matrix of key ``first`` minus key ``second`` (why the head
        prefers one key over another: the softmax sees only score differences)."""
        return self.values[prompt, first] - self.values[prompt, second]

    def heatmap(self, prompt: int = 0, key: int = 0, k: int = 12, matrix: torch.Tensor | None = None, title=None):
        """A plotly heatmap of one matrix (default: prompt ``prompt``'s ``key``-th key; or any ``[Q, K]``
        ``matrix``, such as ``difference()``), cut to the ``k`` query rows and ``k`` key columns of largest
        absolute sum."""
        try:
            import plotly.graph_objects as go
        except ImportError as error:
            raise ImportError('ScoreAttribution.heatmap draws with plotly: pip install "dla_recipes[plots]"') from error
        m = self.values[prompt, key] if matrix is None else matrix
        rows = torch.argsort(m.abs().sum(1), descending=True)[:k].tolist()
        cols = torch.argsort(m.abs().sum(0), descending=True)[:k].tolist()
        cut = m[rows][:, cols]
        limit = float(cut.abs().max()) or 1.0
        fig = go.Figure(go.Heatmap(z=cut.tolist(), x=[self.key_labels[j] for j in cols],
                                   y=[self.query_labels[i] for i in rows], colorscale="RdBu", zmid=0,
                                   zmin=-limit, zmax=limit, colorbar={"title": "q·k"}))
        fig.update_layout(title=title or f"{self.head}: query {self.queries[prompt]} x key {self.keys[prompt][key]} "
                          f"(score {float(self.score[prompt, key]):.3g})",
                          xaxis_title="key component", yaxis_title="query component", yaxis_autorange="reversed")
        return fig
