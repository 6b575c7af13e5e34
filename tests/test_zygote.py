"""The fork server the docs kernels and the quick benchmark's workers start from (``dla_recipes.testing.zygote``): a
forked kernel starts with warm modules but an empty namespace, a forked script sees its own argv, environment and
folder and returns its exit code, and a launcher that is killed takes its child with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import notebook_runner

from dla_recipes.testing.zygote import Zygote

pytestmark = pytest.mark.notebooks  # a zygote imports the whole stack (and the kernel test needs the docs extra)

RUNNER = notebook_runner()


@pytest.fixture(scope="module")
def zygote():
    with Zygote(sys.executable, RUNNER.kernel_env()) as z:
        yield z


def test_a_forked_kernel_has_warm_modules_and_an_empty_namespace(zygote, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys\nprint('torch' in sys.modules)"),
                                         nbformat.v4.new_code_cell("torch.zeros(1)")])
    km = RUNNER._kernel_manager(str(tmp_path), zygote, RUNNER.kernel_env())
    assert km.dla_pid_file  # the zygote's kernel, not a plain one
    try:
        NotebookClient(nb, km=km, timeout=120, kernel_name="python3", allow_errors=True).execute(env=zygote.env)
        cpu = RUNNER._kernel_cpu_seconds(km)  # read from the kernel's pid, which the launcher wrote
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    first, second = (cell.outputs for cell in nb.cells)
    assert "".join(o.get("text", "") for o in first).strip() == "True"  # the zygote imported torch ...
    assert [o.get("ename") for o in second] == ["NameError"]  # ... but this kernel never did
    assert cpu is not None


def test_a_forked_script_gets_its_argv_environment_folder_and_exit_code(zygote, tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'x': os.environ.get('DLA_ZYGOTE_X'),"
                      " 'path0': sys.path[0], 'name': __name__}))\n"
                      "sys.exit(3)\n")
    pid_file = tmp_path / "pid"
    env = dict(os.environ, DLA_ZYGOTE_X="42")
    done = subprocess.run(zygote.command("script", [str(script), "a", "b"], str(pid_file)), env=env,
                          check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"argv": [str(script), "a", "b"], "cwd": str(tmp_path), "x": "42", "path0": str(tmp_path),
                    "name": "__main__"}
    assert int(pid_file.read_text()) != os.getpid()


def test_a_killed_launcher_takes_its_child_with_it(zygote, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    pid_file = tmp_path / "pid"
    launcher = subprocess.Popen(zygote.command("script", [str(script)], str(pid_file)))
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the child outlived its launcher"
        time.sleep(0.05)
