"""The command line of the loopback NDIF server: its arguments, and ``main``, which loads the models and serves them.

Command line (same server, foreground)::

    python -m dla_recipes.testing.loopback --port 8123 --api-key K --model tiny-llama=/path/to/folder ...

Faithfulness: the server process does not import ``dla_recipes`` or ``nnterp`` and refuses to import them (a real NDIF
server has neither the project nor, necessarily, nnterp), so a trace that leans on an installed package which was not
``nnsight.register``-ed for by-value shipping fails here as it would on NDIF. ``python -m`` starts over from
``__main__.py`` run by path for that reason (see there). Security: binds 127.0.0.1 only, requires the API key on
``POST /request`` and ``/stats``, and loads only the allow-listed folders; it still runs client-sent code, so never
expose it.
"""

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

from .app import build_app
from .jobs import BlockedImports, ServedModel
from .protocol import (
    API_KEY_ENV,
    DEFAULT_BLOCKED_IMPORTS,
    DEFAULT_INLINE_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    SERVER_SCRIPT,
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dla_recipes.testing.loopback",
        description="Loopback NDIF server (127.0.0.1 only) serving local model folders to nnsight's remote client.",
    )
    parser.add_argument("--port", type=int, required=True, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--api-key", default=None, help=f"required API key (default: ${API_KEY_ENV})")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=FOLDER", help="serve FOLDER as NAME")
    parser.add_argument("--inline-limit", type=int, default=DEFAULT_INLINE_LIMIT,
                        help="results up to this many bytes go back on the websocket, larger ones by download")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="refuse (413) a request body larger than this")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (LoopbackServer passes its own pid)")
    parser.add_argument("--autocast", action="store_true",
                        help="run each request on a bfloat16 / float16 model inside torch.autocast('cpu', <its "
                             "dtype>), as NDIF runs every request inside torch.autocast('cuda', <its dtype>)")
    parser.add_argument("--ndif", action="store_true",
                        help="run as NDIF does: every model loaded in bfloat16 with sdpa attention, every request "
                             "inside torch.autocast('cpu', bfloat16) (NDIF's torch.autocast('cuda', ...))")
    parser.add_argument("--min-nnsight-version", default=None,
                        help="refuse (400) a client whose nnsight is older, with ndif's own check "
                             "(NDIF_MIN_NNSIGHT_VERSION)")
    parser.add_argument("--blocked-imports", default=",".join(DEFAULT_BLOCKED_IMPORTS),
                        help="comma-separated packages the server refuses to import ('' for none)")
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if not args.api_key:
        parser.error(f"an API key is required: --api-key or ${API_KEY_ENV}")
    models = {}
    for spec in args.model:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--model expects NAME=FOLDER, got {spec!r}")
        if not Path(folder, "config.json").is_file():
            parser.error(f"--model {name}: {folder} has no config.json")
        models[name] = str(Path(folder).resolve())
    if not models:
        parser.error("serve at least one --model NAME=FOLDER")
    args.models = models
    return args


def _exit_with_parent(parent_pid: int) -> None:
    """SIGTERM this server once ``parent_pid`` is gone, so a killed test run leaves no server behind."""
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="loopback-ndif-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if "dla_recipes" in sys.modules and "dla_recipes" in args.blocked_imports.split(","):
        # Run as `python -m dla_recipes...`: the package (and its client-side shim) is already imported, so start
        # over from the server script run by path, where nothing of the project is imported (see __main__.py).
        os.execv(sys.executable, [sys.executable, "-P", str(SERVER_SCRIPT), *(argv or sys.argv[1:])])
    blocked = tuple(name for name in args.blocked_imports.split(",") if name)
    if blocked:
        sys.meta_path.insert(0, BlockedImports(blocked))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    # Before nnsight: it mounts `.save` on every object (CONFIG.APP.PYMOUNT, which client code run here relies on),
    # after which anyio refuses to define its typed-attribute classes ("Attribute 'save' is missing its type
    # annotation") if they are first imported later, e.g. by Starlette's thread pool.
    import anyio._backends._asyncio
    import anyio.abc  # noqa: F401
    import torch
    import uvicorn

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))  # loopback only, never 0.0.0.0
    port = listener.getsockname()[1]
    served = {name: ServedModel(name, folder, autocast=args.autocast, ndif=args.ndif)
              for name, folder in args.models.items()}
    for model in served.values():
        print(f"serving {model.name} as {model.model_key} ({model.dtype}, {model.attention} attention, "
              f"autocast {'on' if model.autocast else 'off'})", flush=True)
    app = build_app(served, args.api_key, args.inline_limit, port, args.max_request_bytes, args.min_nnsight_version)
    config = uvicorn.Config(
        app, log_level="warning", ws="websockets-sansio", timeout_graceful_shutdown=2, lifespan="on"
    )
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
