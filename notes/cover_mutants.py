"""Do the covers kill what the full products killed? Each planted fault of ``tests/mutants.py`` against the cut
tests of ``tests/test_positions.py``, before (the full family x option products, from git) and after (the covers).

    .venv/bin/python notes/cover_mutants.py [--base 4cd9846] > notes/cover_mutants.txt

For each mutant and each version, one pytest subprocess (``DLA_MUTANT=<name>``, one thread) runs the four test
functions the covers changed and counts the items that fail (``FAILED`` lines) and the items run: a mutant is killed
when at least one fails. The "before" file is written next to the tests as ``test_positions_before.py`` for the
run and removed after. A mutant that keeps every block's sum (parts moved within a block, signs into the rest) is
invisible to these sum tests in both versions: ``test_single_parts`` kills those (``test_mutants``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mutants

FUNCTIONS = ("test_every_position_is_the_models_logit", "test_linear_targets_are_the_models",
             "test_token_id_prompts_are_the_models", "test_every_granularity_at_several_positions")


def run(path: Path, mutant: str) -> tuple[int, int, float]:
    """``(failed items, items run, seconds)`` of the cut functions in ``path`` under ``mutant``."""
    env = {k: v for k, v in os.environ.items() if k not in ("DLA_FAST", "PYTEST_ADDOPTS")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="400", DLA_MUTANT=mutant)
    command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-W", "ignore",
               "-n", "2", str(path), "-k", " or ".join(FUNCTIONS)]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    failed = len(re.findall(r"^FAILED ", done.stdout, re.MULTILINE))
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", done.stdout))
    return failed, failed + passed, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="4cd9846", help="the commit of the full products")
    parser.add_argument("--mutants", default="mlp_negated,projection_input_one_earlier,norms_frozen_one_earlier")
    args = parser.parse_args()
    before = ROOT / "tests" / "test_positions_before.py"
    before.write_text(subprocess.run(["git", "show", f"{args.base}:tests/test_positions.py"], cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout)
    try:
        print(f"{'mutant':30s} {'version':8s} {'failed':>7s} {'of':>6s} {'seconds':>8s}  outcome")
        for name in args.mutants.split(","):
            assert name in mutants.MUTANTS, name
            for version, path in (("before", before), ("after", ROOT / "tests" / "test_positions.py")):
                failed, total, seconds = run(path, name)
                print(f"{name:30s} {version:8s} {failed:7d} {total:6d} {seconds:8.1f}  "
                      f"{'killed' if failed else 'SURVIVED'}", flush=True)
    finally:
        before.unlink()


if __name__ == "__main__":
    main()
