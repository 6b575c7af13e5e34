"""One process that imports what every mutant's pytest run imports (torch, transformers, nnsight, nnterp, the
package) once, then runs each run's pytest in a fork of itself (``test_mutants.run_targets``).

A fresh ``python -m pytest`` spends ~5 s of CPU importing before its first test; a fork starts with it done. Each
request is one JSON line on stdin, ``{"args": [...], "cwd": ..., "out": <file>, "mutant": <name or null>}``: the
child sets ``DLA_MUTANT`` (the conftest applies the mutant when it is imported, in the child only), sends its
stdout and stderr to ``out`` and exits with pytest's exit code, which the zygote writes back as one JSON line.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from importlib.metadata import entry_points

import pytest


def preload() -> None:
    """What a fresh pytest of the targets imports, in its order: pytest's plugins (anyio's fails when it comes after
    nnsight), then the package (before nnterp: its shim) and the libraries under it."""
    for plugin in entry_points(group="pytest11"):
        plugin.load()
    for name in ("dla_recipes", "nnsight", "nnterp", "torch", "transformers"):
        importlib.import_module(name)


ENV = "DLA_MUTANT"


def run(request: dict) -> int:
    """One pytest run in a fork; its exit code."""
    pid = os.fork()
    if pid == 0:  # the child: its own output file, its own mutant, pytest, then exit without cleanup
        code = 3
        try:
            out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            if request.get("mutant"):
                os.environ[ENV] = request["mutant"]
            os.chdir(request["cwd"])
            code = int(pytest.main(list(request["args"])))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    preload()
    for line in sys.stdin:
        if line.strip():
            print(json.dumps({"returncode": run(json.loads(line))}), flush=True)


if __name__ == "__main__":
    main()
