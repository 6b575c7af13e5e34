"""The tests can fail: each planted fault of ``mutants.py`` makes some of its target tests fail.

Each mutant runs ``mutants.TARGETS`` in a subprocess (``DLA_MUTANT=<name>``, applied by ``conftest.py`` at import).
A mutant is killed when that pytest exits 1 (tests failed) with at least one ``FAILED`` line in its ``-rf`` summary;
exit 0 (everything passed) is a mutant the tests miss, and any other exit (2: collection error or interruption,
3: internal error, 4: usage, 5: nothing collected) a broken harness, which fails here too. The same targets must pass
without a mutant first (a control run), else a failure under a mutant would prove nothing. The kills are printed as
a table at the end of the session and named in each assertion message. The subprocess tests are marked
``mutants`` (``-m "not mutants"`` leaves them out); the two cheap checks of the harness itself are not.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mutants
import pytest

ROOT = Path(__file__).resolve().parents[1]
FAILED = re.compile(r"^FAILED (\S+) - ([\w.]+)", re.MULTILINE)  # -rf: "FAILED <nodeid> - <error type>: ..."
KILLS = ("AssertionError", "ExactnessError")  # a test that sees the fault; any other error: the wrapper crashed
TIMEOUT = 300  # seconds per subprocess; each takes ~15 s of CPU (~40 s wall on a loaded 2-core machine)
RESULTS: dict[str, tuple[str, float, list[str]]] = {}  # name -> (outcome, seconds, killing tests)


class Zygote:
    """``tests/mutant_zygote.py`` started once per process that runs mutants: each run a fork of it, the imports
    already done (a fresh pytest spends ~5 s of CPU on them, ~100 s over every mutant and the control)."""

    process: subprocess.Popen | None = None

    @classmethod
    def run(cls, args: list[str], env: dict, mutant: str | None) -> subprocess.CompletedProcess:
        if cls.process is None or cls.process.poll() is not None:
            cls.process = subprocess.Popen([sys.executable, str(ROOT / "tests" / "mutant_zygote.py")], cwd=ROOT,
                                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            atexit.register(cls.process.kill)
        with tempfile.NamedTemporaryFile("r", suffix=".log", delete=False) as out:
            request = {"args": args, "cwd": str(ROOT), "out": out.name, "mutant": mutant}
            cls.process.stdin.write(json.dumps(request) + "\n")
            cls.process.stdin.flush()
            ready, _, _ = select.select([cls.process.stdout], [], [], TIMEOUT)
            if not ready:
                cls.process.kill()
                raise subprocess.TimeoutExpired(args, TIMEOUT)
            answer = json.loads(cls.process.stdout.readline())
            text = Path(out.name).read_text()
        os.unlink(out.name)
        return subprocess.CompletedProcess(args, answer["returncode"], text, "")


def run_targets(mutant: str | None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``mutants.TARGETS`` in a fresh pytest, under ``mutant`` (None: unmutated): a fork of the ``Zygote``."""
    env = {k: v for k, v in os.environ.items() if k not in (mutants.ENV, "DLA_RECORD", "DLA_FAST", "PYTEST_ADDOPTS")}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["COLUMNS"] = "400"  # the -rf lines keep their error type
    args = ["-q", "-rfE", "-p", "no:cacheprovider", "-W", "ignore", *mutants.TARGETS]
    start = time.monotonic()
    done = Zygote.run(args, env, mutant)
    return done, time.monotonic() - start


def tail(done: subprocess.CompletedProcess, lines: int = 30) -> str:
    return "\n".join((done.stdout + done.stderr).splitlines()[-lines:])


@pytest.fixture(scope="module")
def control():
    """The targets pass on the package as it is (else no failure under a mutant means anything)."""
    done, seconds = run_targets(None)
    RESULTS["(none: control)"] = ("passed" if done.returncode == 0 else f"exit {done.returncode}", seconds, [])
    if done.returncode != 0 or "dla mutant applied" in done.stdout:
        pytest.fail(f"the mutant targets fail without a mutant (exit {done.returncode}):\n{tail(done)}")
    return done


@pytest.mark.mutants
def test_the_targets_exist_and_pass_unmutated(control, record_property):
    record_property("mutant", ["(none: control)", *RESULTS["(none: control)"]])  # for the kill table (conftest)
    collected = re.search(r"(\d+) passed", control.stdout)
    assert collected and int(collected.group(1)) == len(mutants.TARGETS), tail(control)


def classify(name: str, returncode: int, stdout: str) -> tuple[str, list[str], list[str]]:
    """``(outcome, killers, crashed)`` of one mutant's run: ``"killed"`` (exit 1, a target failed on an assertion or
    the self-check), ``"SURVIVED"`` (exit 0) or ``"HARNESS BROKEN"`` (the mutant not applied, another exit code, or
    a target that crashed with another error: the wrapper, not the package, failed)."""
    failures = FAILED.findall(stdout)
    killers = [nodeid for nodeid, error in failures if error.rsplit(".", 1)[-1] in KILLS]
    crashed = [f"{nodeid} ({error})" for nodeid, error in failures if error.rsplit(".", 1)[-1] not in KILLS]
    if f"dla mutant applied: {name} " not in stdout or returncode not in (0, 1) or crashed:
        return "HARNESS BROKEN", killers, crashed
    return ("killed" if returncode == 1 and killers else "SURVIVED"), killers, crashed


@pytest.mark.mutants
@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_killed(name, control, record_property):
    done, seconds = run_targets(name)
    outcome, killers, crashed = classify(name, done.returncode, done.stdout)
    RESULTS[name] = (outcome, seconds, killers)
    record_property("mutant", [name, outcome, seconds, killers])  # the report carries it to the kill table
    what = mutants.MUTANTS[name].what
    assert outcome != "HARNESS BROKEN", (
        f"{name}: harness broken (pytest exit {done.returncode}; crashed: {crashed or 'none'}; the mutant's line "
        f"{'found' if 'dla mutant applied' in done.stdout else 'missing'}):\n{tail(done)}")
    assert outcome == "killed", f"{name} ({what}) survived: all {len(mutants.TARGETS)} targets passed"
    print(f"{name}: killed by {len(killers)} of {len(mutants.TARGETS)}: {', '.join(killers)}")


def test_every_mutant_patches_a_function_with_the_parameters_it_reads():
    """Cheap, no subprocess: each target exists and has the parameters its wrapper reads by name."""
    import importlib
    import inspect

    for mutant in mutants.MUTANTS.values():
        module_name, function_name = mutant.target.split(":")
        function = getattr(importlib.import_module(module_name), function_name)
        assert set(mutant.needs) <= set(inspect.signature(function).parameters), mutant.name


def test_the_outcome_of_a_run_is_read_strictly():
    """The classification itself can fail: exit 0 survives, exit 2+ or a crash or a missing mutant line is broken."""
    line = "dla mutant applied: m (x:y)\n"
    failed = "FAILED tests/a.py::t[x] - AssertionError: off\nFAILED tests/b.py::u - dla_recipes.errors.ExactnessError: e\n"
    assert classify("m", 1, line + failed) == ("killed", ["tests/a.py::t[x]", "tests/b.py::u"], [])
    assert classify("m", 0, line)[0] == "SURVIVED"
    assert classify("m", 1, line)[0] == "SURVIVED"  # exit 1 without a failed test: errors only, nothing killed
    assert classify("m", 2, line + failed)[0] == "HARNESS BROKEN"  # collection error / interrupted
    assert classify("m", 4, "")[0] == "HARNESS BROKEN"  # conftest could not apply the mutant
    assert classify("m", 1, failed)[0] == "HARNESS BROKEN"  # the mutant line is missing
    assert classify("m", 1, line + "FAILED tests/a.py::t - TypeError: bad\n")[0] == "HARNESS BROKEN"


def summary_lines(rows) -> list[str]:
    """The kill table of ``rows`` (``(mutant, outcome, seconds, killers)`` as the tests record them: under
    pytest-xdist the reports carry them from the worker): each mutant, its outcome, its time, the tests that killed
    it (short names)."""
    def short(nodeid: str) -> str:
        return nodeid.replace(mutants.SINGLE, "single").replace(mutants.FAMILIES, "sums")

    lines = [f"{'mutant':30s} {'outcome':14s} {'seconds':>7s}  killed by"]
    for name, outcome, seconds, killers in rows:
        lines.append(f"{name:30s} {outcome:14s} {seconds:7.1f}  {' '.join(short(k) for k in killers) or '-'}")
    return lines
