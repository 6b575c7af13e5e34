"""The FastAPI app of the loopback NDIF server: its state, the lifespan that announces it ready, its endpoints.

Runs in the server process (``main``); the endpoints are in ``handlers``.
"""

import asyncio
import contextlib
import os
from typing import Any

from .handlers import add_query_endpoints, add_request_endpoints, key_check
from .jobs import ServedModel, State
from .protocol import DEFAULT_MAX_REQUEST_BYTES, READY_PREFIX


def build_app(served: dict[str, ServedModel], api_key: str, inline_limit: int, port: int,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, min_nnsight_version: str | None = None):
    """The FastAPI app (see ``dla_recipes.testing.loopback.handlers`` for the endpoints)."""
    from fastapi import FastAPI

    state = State(served, api_key, inline_limit, port, max_request_bytes)
    state.min_nnsight_version = min_nnsight_version
    tasks: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any):
        state.run_lock = asyncio.Lock()
        print(f"{READY_PREFIX} port={state.port} pid={os.getpid()} models={sorted(state.served)}", flush=True)
        yield

    app = FastAPI(title="loopback NDIF", lifespan=lifespan)
    app.state.loopback = state
    check_key = key_check(state)
    add_request_endpoints(app, state, tasks, check_key)
    add_query_endpoints(app, state, check_key)
    return app
