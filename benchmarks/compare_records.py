"""Compare two attribution records written by the test suite with ``DLA_RECORD=<path>`` (see ``tests/conftest.py``).

    python benchmarks/compare_records.py BEFORE.pt AFTER.pt

Calls are matched by ``(test nodeid, index of the call within the test)``. A pair is identical when every recorded
field is bit-identical: ``torch.equal`` on tensors (same dtype and shape, NaN where the other has NaN), ``==`` on
floats (NaN equal to NaN), strings, tuples and lists, recursively; and for a call that raised, the same exception
class (a changed message is reported, not counted). Diagnostics may gain keys: a key only in AFTER is reported, not
counted as a difference; a key removed, or a changed value, is a difference (and is reported with the keys too).
Exit status 0 only when no matched call differs and no call is only in one file.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

MISSING = object()


def same(a, b) -> bool:
    """Bit-identical, recursively (NaN equals NaN at the same places)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.equal(torch.isnan(a), torch.isnan(b))) and bool(
                torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
            )
        return bool(torch.equal(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def max_abs_difference(a, b) -> str:
    """How far apart two differing values are, in words (the max |a - b| where both are numbers)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} -> {tuple(b.shape)}"
        if a.dtype != b.dtype:
            note = f" (dtype {a.dtype} -> {b.dtype})"
        else:
            note = ""
        if a.numel() == 0:
            return f"empty{note}"
        x, y = a.double(), b.double()
        nan_moved = int((torch.isnan(x) != torch.isnan(y)).sum())
        both = ~(torch.isnan(x) | torch.isnan(y))
        diff = (x[both] - y[both]).abs()
        text = f"max abs diff {float(diff.max()):.3g}" if diff.numel() else "no finite pair"
        return text + (f", NaN at {nan_moved} other places" if nan_moved else "") + note
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return f"{a!r} -> {b!r} (abs diff {abs(a - b):.3g})"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        where = [i for i, (x, y) in enumerate(zip(a, b)) if not same(x, y)]
        return f"{len(where)} of {len(a)} items differ, first at [{where[0]}]: {short(a[where[0]])} -> " \
            f"{short(b[where[0]])}" if where else "container type differs"
    return f"{short(a)} -> {short(b)}"


def short(value, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def compare_call(before: dict, after: dict) -> tuple[list[tuple[str, str]], list[str]]:
    """``(differences, diagnostics notes)`` of one matched call: ``[(field, how)]`` and lines about diagnostics."""
    differences, notes = [], []
    if "exception" in before or "exception" in after:
        a, b = before.get("exception"), after.get("exception")
        if a != b:
            differences.append(("exception", f"{a or 'returned'} -> {b or 'returned'}"))
        elif before.get("message") != after.get("message"):
            notes.append(f"exception message changed: {short(before.get('message'))} -> {short(after.get('message'))}")
        return differences, notes
    if before.get("entry") != after.get("entry"):
        differences.append(("entry", f"{before.get('entry')} -> {after.get('entry')}"))
    fields_a, fields_b = before["fields"], after["fields"]
    for key in sorted(set(fields_a) | set(fields_b)):
        if key == "diagnostics":
            continue
        a, b = fields_a.get(key, MISSING), fields_b.get(key, MISSING)
        if a is MISSING or b is MISSING:
            differences.append((key, "missing before" if a is MISSING else "missing after"))
        elif not same(a, b):
            differences.append((key, max_abs_difference(a, b)))
    diag_a, diag_b = fields_a.get("diagnostics", {}) or {}, fields_b.get("diagnostics", {}) or {}
    for key in sorted(set(diag_a) | set(diag_b)):
        if key not in diag_a:
            notes.append(f"diagnostics[{key!r}] added")
        elif key not in diag_b:
            notes.append(f"diagnostics[{key!r}] removed")
            differences.append((f"diagnostics[{key!r}]", "removed"))
        elif not same(diag_a[key], diag_b[key]):
            notes.append(f"diagnostics[{key!r}] changed")
            differences.append((f"diagnostics[{key!r}]", max_abs_difference(diag_a[key], diag_b[key])))
    return differences, notes


def load(path: str) -> dict:
    data = torch.load(path, map_location="cpu", weights_only=False)
    return data["calls"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--limit", type=int, default=200, help="list at most this many differences of each kind")
    args = parser.parse_args(argv)
    before, after = load(args.before), load(args.after)
    matched = sorted(set(before) & set(after))
    only_before, only_after = sorted(set(before) - set(after)), sorted(set(after) - set(before))

    identical, differing, diag_lines = 0, [], []
    for key in matched:
        differences, notes = compare_call(before[key], after[key])
        if differences:
            differing.append((key, differences))
        else:
            identical += 1
        diag_lines += [(key, note) for note in notes]

    print(f"{Path(args.before).name}: {len(before)} calls; {Path(args.after).name}: {len(after)} calls")
    print(f"matched {len(matched)}: {identical} bit-identical, {len(differing)} differ")
    print(f"only in {args.before}: {len(only_before)}; only in {args.after}: {len(only_after)}")
    if differing:
        print("\nDIFFER (test [call index]: field: how)")
        for (nodeid, index), differences in differing[: args.limit]:
            for field_name, how in differences:
                print(f"  {nodeid} [{index}]: {field_name}: {how}")
        if len(differing) > args.limit:
            print(f"  ... and {len(differing) - args.limit} more calls")
    for label, keys in (("ONLY BEFORE", only_before), ("ONLY AFTER", only_after)):
        if keys:
            print(f"\n{label}")
            for nodeid, index in keys[: args.limit]:
                record = (before if label == "ONLY BEFORE" else after)[(nodeid, index)]
                print(f"  {nodeid} [{index}] ({record.get('entry')}, {record.get('exception', 'returned')})")
            if len(keys) > args.limit:
                print(f"  ... and {len(keys) - args.limit} more")
    if diag_lines:
        counts: dict[str, int] = {}
        for _, note in diag_lines:
            kind = note.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
        print("\nDIAGNOSTICS KEYS AND MESSAGES (an added key or a changed message is not a difference; a removed key or a"
              " changed value is, and is listed above)")
        for kind, count in sorted(counts.items()):
            print(f"  {kind}: {count} calls")
        for (nodeid, index), note in diag_lines[: args.limit]:
            if note.startswith("exception message"):
                print(f"  {nodeid} [{index}]: {note}")
    return 0 if not differing and not only_before and not only_after else 1


if __name__ == "__main__":
    sys.exit(main())
