"""Which stack the suite runs on: the pinned one (``constraints.txt``), or the newest releases over it
(``constraints-newest.txt``, installed into ``build/newest`` and put first on ``PYTHONPATH`` by ``make test``'s
newest-stack stage, which sets ``DLA_STACK=newest``). The versions imported are the pinned ones, so a stage that
says it ran the newest stack did; and ``pyproject.toml`` declares, for transformers, nnsight and nnterp, exactly the
range from the pinned version to the newest, the two that run here."""

from __future__ import annotations

import importlib
import os
import re
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DECLARED = ("transformers", "nnsight", "nnterp")


def pins(name: str) -> dict[str, str]:
    """``{package: version}`` of the ``==`` lines of a constraints file."""
    found = {}
    for line in (ROOT / name).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s#;]+)", line.strip())
        if match:
            found[match.group(1).lower().replace("_", "-")] = match.group(2)
    return found


PINNED, NEWEST = pins("constraints.txt"), pins("constraints-newest.txt")


@pytest.mark.parametrize("name", DECLARED)
def test_the_imported_version_is_the_stacks(name):
    stack = os.environ.get("DLA_STACK", "pinned")
    assert stack in ("pinned", "newest"), f"DLA_STACK={stack!r}: 'pinned' or 'newest'"
    wanted = NEWEST.get(name, PINNED[name]) if stack == "newest" else PINNED[name]
    module = importlib.import_module(name)
    from importlib.metadata import version

    have = getattr(module, "__version__", None) or version(name)
    assert Version(have) == Version(wanted), f"{stack} stack: {name} {have} imported, {wanted} pinned"


@pytest.mark.parametrize("name", DECLARED)
def test_pyproject_declares_the_range_that_runs_here(name):
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(SpecifierSet(d[len(name):].split(";")[0]) for d in declared
                if re.match(rf"^{name}\s*[<>=!~]", d))
    low, high = Version(PINNED[name]), Version(NEWEST.get(name, PINNED[name]))
    assert low in spec and high in spec, f"{name}: {spec} leaves out a version this suite runs ({low}, {high})"
    after = Version(f"{high.major}.{high.minor}.{high.micro + 1}")
    assert after not in spec, f"{name}: {spec} allows {after}, newer than the newest this suite runs ({high})"
    assert low == min(Version(s.version) for s in spec if s.operator in (">=", "==")), \
        f"{name}: {spec} allows versions below {low}, which no test here runs"
