"""A dataset's per-prompt rows as a directory of Parquet parts: one part a chunk, whole or absent, resumable.

    runs/ioi.parquet/
      _dla_recipes.json           what wrote it (model, by, position, columns, labels): a resumed run must match
      part-000000000000.parquet   the rows of one chunk (named by its first row, zero-padded: names sort in row order)
      part-000000000032.parquet   ...

``pandas.read_parquet("runs/ioi.parquet")`` reads every part in row order (pyarrow skips names starting with ``_``
or ``.``). A part is written under a hidden name and renamed into place once complete, so a run killed mid-write
leaves only whole parts (and perhaps a hidden ``.part-*.tmp``, removed by the next run); a resumed run skips the
rows the parts hold.

The columns, one row per prompt (per prompt and position with several positions; ``table``):
``row`` (int64: the row's index in the data), ``position`` (int64: the prompt's own position index; absent with
``reduce="sum"``), ``prompt``, ``target``, ``contrast`` (with a contrast), ``constant``, ``logit``, ``error``
(``|parts + constant - logit|``), then one float32 column per component label (``"embed"``, ``"L0.attn"``, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import InputError

FORMAT = "dla_recipes.rows"
VERSION = 1
META = "_dla_recipes.json"
FIXED = ("row", "position", "prompt", "target", "contrast", "constant", "logit", "error")  # before the components


def pyarrow():
    """``pyarrow.parquet``, or an ``InputError`` saying how to install it (the ``data`` extra)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("writing rows to a Parquet file (out=...) needs pyarrow: pip install dla_recipes[data]") from None
    return pq


def table(attr, rows, contrast: bool):
    """The rows of ``attr`` (an ``Attribution`` of ``len(rows)`` prompts, or a ``PositionAttribution``: one row a
    site) as a pandas DataFrame, ``rows[i]`` the data's index of prompt ``i`` (see the module docstring)."""
    import numpy as np
    import pandas as pd

    sites = getattr(attr, "sites", attr)
    if sites is attr:  # one row a prompt
        owner = torch.arange(len(attr))
    else:  # one row a site, prompt-major: each site's prompt
        owner = torch.arange(len(attr)).unsqueeze(1).expand_as(attr.index)[attr.mask]
    data = {"row": np.asarray(rows, dtype=np.int64)[owner.numpy()]}
    if all(isinstance(p, int) for p in sites.positions):  # reduce="sum" holds each prompt's positions: no column
        data["position"] = np.asarray(sites.positions, dtype=np.int64)
    prompts = attr.prompts
    data["prompt"] = np.array([str(prompts[b]) for b in owner.tolist()], dtype=object)
    data["target"] = np.array([str(t) for t in sites.target_tokens], dtype=object)
    if contrast:
        data["contrast"] = np.array([str(t) for t in sites.contrast_tokens], dtype=object)
    data["constant"] = sites.constant.float().numpy()
    data["logit"] = sites.logit.float().numpy()
    data["error"] = (sites.values.double().sum(-1) + sites.constant.double() - sites.logit.double()).abs().float().numpy()
    head = pd.DataFrame(data)
    values = pd.DataFrame(sites.values.float().numpy(), columns=list(sites.labels))
    return pd.concat([head, values], axis=1)


class Parts:
    """The directory ``path`` of Parquet parts (the module docstring): its metadata, the rows it holds, one more
    part written atomically."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise InputError(f"out={str(path)!r} is a file: out= names a directory of Parquet parts (pandas reads it "
                             "with pandas.read_parquet(out)); give a new path or one an earlier run wrote")

    def meta(self) -> dict | None:
        """What the run that made the directory wrote in ``_dla_recipes.json``, or None (a new directory)."""
        file = self.path / META
        if not file.exists():
            if self.path.exists() and any(self.path.glob("part-*.parquet")):
                raise InputError(f"out={str(self.path)!r} holds Parquet parts but no {META}: it was not written by "
                                 "attribute_dataset; give another path")
            return None
        meta = json.loads(file.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise InputError(f"out={str(self.path)!r} was not written by this version of attribute_dataset "
                             f"(format {meta.get('format')!r} version {meta.get('version')!r}); give another path")
        return meta

    def start(self, meta: dict) -> None:
        """Begin or resume: a new directory gets ``meta``; an existing one must have been written by the same call
        (``meta``'s every key but ``labels``, which a run learns at its first chunk), else an ``InputError``."""
        old = self.meta()
        if old is None:
            self.path.mkdir(parents=True, exist_ok=True)
            self.write_meta({"format": FORMAT, "version": VERSION, **meta})
            return
        differ = [key for key in meta if key != "labels" and old.get(key) != meta[key]]
        if differ:
            was = "; ".join(f"{key}: {old.get(key)!r} there, {meta[key]!r} now" for key in differ)
            raise InputError(f"out={str(self.path)!r} was written by a different call ({was}): resuming it would mix "
                             "two runs' rows. Call with the same arguments to resume, or give a new out=")
        for stale in self.path.glob(".part-*.tmp"):  # a part a killed run did not finish
            stale.unlink()

    def write_meta(self, meta: dict) -> None:
        tmp = self.path / f".{META}.tmp"
        tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, self.path / META)

    def check_labels(self, labels: list[str]) -> None:
        """The first chunk's labels are kept in the metadata; every later chunk (of any run) must have the same."""
        meta = self.meta()
        if meta.get("labels") is None:
            self.write_meta({**meta, "labels": list(labels)})
        elif meta["labels"] != list(labels):
            raise InputError(f"this chunk's components ({len(labels)}) are not the {len(meta['labels'])} of the rows "
                             f"already in out={str(self.path)!r}: a different model or granularity; give a new out=")

    def done(self) -> dict[int, str]:
        """``{row: prompt}`` of every row the parts hold."""
        pq = pyarrow()
        out: dict[int, str] = {}
        for part in sorted(self.path.glob("part-*.parquet")):
            read = pq.read_table(part, columns=["row", "prompt"])
            out.update(zip(read.column("row").to_pylist(), read.column("prompt").to_pylist()))
        return out

    def write(self, frame) -> Path:
        """``frame`` (``table``'s rows of one chunk) as one more part, renamed into place once written whole."""
        import pyarrow as pa

        pq = pyarrow()
        first = int(frame["row"].min())
        name = f"part-{first:012d}.parquet"
        tmp = self.path / f".{name}.tmp"
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp)
        os.replace(tmp, self.path / name)
        return self.path / name
