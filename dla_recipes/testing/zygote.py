"""A fork server for the project's own many short Python processes: Jupyter kernels (the docs), benchmark workers and
loopback NDIF servers (the tests), each forked from one process that has already imported their libraries.

A fresh interpreter spends about 5 s of CPU importing torch, transformers, nnsight and the rest before its first
line runs; the docs start 27 kernels, the quick benchmark about ten timing workers, the suite about 27 loopback
servers, so that import was about a third of each. A *zygote* (``serve``) imports them once, runs no torch op (a
fork after torch's thread pools start is not safe), and forks a child per request. A child starts with warm
``sys.modules`` only: a kernel's namespace is empty (a notebook that forgets an import fails as it would for a
user), a script runs as ``__main__``. What a child reads from its environment at start comes from the request
(``os.environ`` is replaced, torch's thread count set from ``OMP_NUM_THREADS``); a caller whose environment
differs in what is read at start (``start_env``; ``execute.py``: a remote recipe's ``NDIF_*``) starts an
ordinary process, or another zygote, instead. A peak-memory worker forks from a zygote started in its own environment
(glibc reads ``MALLOC_*`` at process start) and measures its peak above the state after loading, so the zygote's
pages, resident from the start, are not counted in it (``benchmarks/run.py``).
The zygote of loopback servers imports the server's stack only, never this package (a real NDIF server has
neither it nor nnterp: ``loopback.server.SERVER_PRELOAD``).

This file is run by its path (as a package module it would import the package first), in two roles; the launcher
imports nothing heavy:

- ``python zygote.py serve SOCKET MODULES``: import the comma-separated ``MODULES``, then accept requests on the
  UNIX socket ``SOCKET``. A request is one JSON line ``{"mode": ..., "argv": [...], "env": {...}, "cwd": ...}``
  with the launcher's stdin, stdout and stderr passed as file descriptors; the zygote forks, the child takes its
  own session, those descriptors, that environment and folder, and becomes ``ipykernel``'s launcher on ``argv``
  (mode ``kernel``) or runs the script ``argv[0]`` with ``sys.argv = argv`` (``script``, as ``python script.py``;
  ``safe-script``, as ``python -P script.py``: its folder not on ``sys.path``). The zygote answers ``{"pid": N}``,
  then ``{"exit": code}`` once the child ends. When the launcher's connection closes first (it was killed), the
  zygote kills the child. It stops when its stdin closes.
- ``python zygote.py launch SOCKET PIDFILE MODE ARGV...``: what a caller starts in place of ``python -m
  ipykernel_launcher ...`` or ``python script.py ...``: asks the zygote for the child, writes its pid to
  ``PIDFILE`` (the caller reads the child's pid and CPU time there), forwards SIGINT and SIGTERM to it, and exits
  with its exit code.

``Zygote`` starts (on the first command asked of it) and stops a ``serve`` process and builds the launch command.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys

# what a client-side child imports (the docs add their notebooks' libraries and ipykernel); the loopback NDIF
# server's zygote imports the server's stack instead, never the package (``loopback.server.SERVER_PRELOAD``)
PRELOAD = ("dla_recipes", "nnsight", "nnterp", "torch", "transformers", "transformers.models.llama.modeling_llama")


# variables that change between calls of one caller and nothing a process reads at start: pytest's name of the
# running test (a fixture and its test differ in it)
NOT_READ_AT_START = ("PYTEST_CURRENT_TEST",)


def start_env(env: dict, *ignored: str) -> dict:
    """``env`` less what a child does not read at start (``NOT_READ_AT_START`` and ``ignored``): two environments
    equal here start children that import alike, so one zygote serves both."""
    return {k: v for k, v in env.items() if k not in NOT_READ_AT_START and k not in ignored}


def preload(names) -> None:
    """Import ``names`` in order (the package first: its nnterp shim must load before nnterp)."""
    import importlib

    for name in names:
        importlib.import_module(name)


def _read_line(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One JSON line from ``conn`` and the descriptors that came with it."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _flags, _addr = socket.recv_fds(conn, 1 << 16, 8)
        if not chunk:
            break
        data, fds = data + chunk, fds + list(got)
    return data, fds


def _become_child(request: dict, fds: list[int]) -> None:
    """In the forked child: the launcher's stdio, environment and folder, then the kernel or the script; never
    returns."""
    code = 1
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if request["mode"] == "kernel":
            from ipykernel import kernelapp

            # the traits ipykernel read from the environment at import (the zygote's): from the kernel's own, so
            # it knows it has a parent (and prints no "Ctrl-C will not work" banner)
            argv = [*request["argv"], f"--IPKernelApp.parent_handle={os.environ.get('JPY_PARENT_PID') or 0}"]
            sys.argv = ["ipykernel_launcher", *argv]
            sys.path.insert(0, os.getcwd())  # as ``python -m ipykernel_launcher`` has it
            kernelapp.launch_new_instance(argv=argv)
        else:  # "script", or "safe-script" as ``python -P script.py``: the script's folder not on sys.path
            import runpy

            sys.argv = list(request["argv"])
            if request["mode"] == "script":
                sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as ``python script.py`` has it
            runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:  # as the interpreter exits: None is 0, a number itself, anything else printed, 1
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report on the kernel's stderr, exit non-zero
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str, names) -> None:
    """Preload ``names``, then fork a child per request until stdin closes (the parent is gone)."""
    preload(names)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    kernels: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(timeout=0.2):
            if key.data == "parent":
                if not sys.stdin.readline():  # the parent closed our stdin: stop, killing what is left
                    for pid in kernels:
                        _kill(pid)
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                data, fds = _read_line(conn)
                request = json.loads(data)
                pid = os.fork()
                if pid == 0:
                    for open_socket in (listener, conn, *kernels.values()):
                        open_socket.close()
                    _become_child(request, fds)
                for fd in fds:
                    os.close(fd)
                kernels[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:  # the launcher's connection: it only ever closes (the launcher died), so kill its kernel
                pid = key.data
                _kill(pid)
        while kernels:  # reap the kernels that ended; tell their launchers
            pid, status = os.waitpid(-1, os.WNOHANG) if kernels else (0, 0)
            if pid == 0:
                break
            conn = kernels.pop(pid, None)
            if conn is not None:
                selector.unregister(conn)
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch(path: str, pid_file: str, mode: str, argv: list[str]) -> int:
    """Ask the zygote at ``path`` for a child (``mode``: kernel or script) on ``argv``; wait for it; its exit
    code."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"mode": mode, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    reader = conn.makefile("r")
    pid = json.loads(reader.readline())["pid"]
    with open(pid_file, "w") as out:
        out.write(str(pid))

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    line = reader.readline()
    return json.loads(line)["exit"] if line else 1


class Zygote:
    """The ``serve`` process, started on the first kernel asked of it (a context manager: stopped, with what it
    forked, on exit); ``env`` is the environment it runs in, which a forked kernel shares."""

    def __init__(self, python: str, env: dict, preload: tuple[str, ...] = PRELOAD):
        import threading

        self.python, self.env, self.preload = python, env, tuple(preload)
        self.process, self.folder = None, None
        self.starting = threading.Lock()  # callers on several threads (the benchmark's memory pool) start it once

    def start(self) -> None:
        """Start the ``serve`` process and wait until it has imported ``preload`` (once: a no-op when started)."""
        with self.starting:
            if self.process is None:
                self._start()

    def _start(self) -> None:
        import subprocess
        import tempfile

        self.folder = tempfile.TemporaryDirectory(prefix="dla-zygote-")
        self.socket = os.path.join(self.folder.name, "zygote.sock")
        process = subprocess.Popen([self.python, __file__, "serve", self.socket, ",".join(self.preload)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, text=True)
        if process.stdout.readline().strip() != "ready":
            process.kill()
            raise RuntimeError(f"the zygote importing {', '.join(self.preload)} did not start (its stderr is above)")
        self.process = process

    def fits(self, env: dict) -> bool:
        """Whether a child started in ``env`` imports as this zygote's children do (``start_env``)."""
        return start_env(env) == start_env(self.env)

    def command(self, mode: str, argv: list[str], pid_file: str) -> list[str]:
        """What a caller runs in place of ``python -m ipykernel_launcher ARGV`` (``mode="kernel"``), ``python
        ARGV`` (``"script"``) or ``python -P ARGV`` (``"safe-script"``); the child's pid is written to
        ``pid_file``."""
        self.start()
        return [self.python, __file__, "launch", self.socket, pid_file, mode, *argv]

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except Exception:  # noqa: BLE001 - stuck: kill it
                self.process.kill()
        if self.folder is not None:
            self.folder.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run by its path: this folder's modules (tiny, hooks, ...) are not top-level modules
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], [name for name in sys.argv[3].split(",") if name])
    elif sys.argv[1:2] == ["launch"]:
        sys.exit(launch(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET MODULES | launch SOCKET PIDFILE kernel|script ARGV...")
