"""The endpoints of the loopback NDIF server, as FastAPI routes on the app ``build_app`` makes.

Endpoints (those nnsight 0.8.1's client calls, plus two for tests):

- ``WS  /subscribe``      sends ``{"session_id": ...}``, then every status of that session's requests: JSON text frames,
                          and on COMPLETED either a binary frame (``ResponseModel.pickle()`` carrying the result blob,
                          when it is at most ``inline_limit`` bytes, as NDIF does under its Redis publish limit) or a
                          JSON frame whose ``data`` is a one-shot download URL.
- ``POST /request``       multipart ``data`` (the ``RequestModel`` JSON) + ``blob`` (the serialized trace); header
                          ``ndif-api-key``. 401 missing key, 403 wrong key, 404 model not hosted, 413 request larger
                          than ``max_request_bytes``, 422 bad envelope, 400 a client nnsight older than the
                          server's ``min_nnsight_version`` (ndif's own ``validate_client_versions``), else the
                          RECEIVED response. The client shows
                          the ``detail`` as ``RemoteError``. The server mints the request id (a client-sent ``id`` is
                          ignored) and never trusts the client's ``trusted`` / ``api_key`` fields.
- ``GET /result/{id}``    the result blob (zstd-compressed ``torch.save`` bytes), once; what the client downloads.
                          The COMPLETED message hands out a presigned URL (``?token=`` an HMAC of the id under the
                          key, as NDIF's object-store URLs are presigned): without that token or the key header, 401.
- ``GET /response/{id}``  latest status of a non-blocking request (``trace(..., blocking=False)``).
- ``GET /status``, ``GET /env``, ``GET /connected``, ``GET /whoami``: as NDIF (``nnsight.status()``,
                          ``nnsight.compare()``), but key required; ``/status`` names models, never folders.
- ``GET /ping``           liveness, the one endpoint without a key (it answers ``pong`` and nothing else).
- ``GET /stats``          per-request records; ``DELETE /stats`` clears them.
- ``POST /faults``        (tests) ``{"unavailable": n}``: the next ``n`` ``POST /request`` answer 503 Service
                          Unavailable, as a restarting deployment does, to exercise the client's retries.

Every endpoint but ``/ping`` requires the key (header ``ndif-api-key``; for ``/result`` the presigned token will do).
"""

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from .jobs import Job, JobFailed, ServedModel, State, execute, make_record, parse_model_key
from .protocol import API_KEY_HEADER, result_token


def key_check(state: State) -> Callable[[str | None], None]:
    """The key check of every endpoint but ``/ping``: 401 without a key, 403 with another one than the server's."""
    from fastapi import HTTPException

    def check_key(given: str | None) -> None:
        if not given:
            raise HTTPException(
                401, "Missing API key: this loopback NDIF server requires one. Set NDIF_API_KEY (or nnsight's "
                "CONFIG.API.APIKEY, e.g. with LoopbackServer.client()) to the server's key.",
            )
        import hmac

        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            raise HTTPException(403, "Invalid API key: the loopback NDIF server does not accept this key.")

    return check_key


def add_request_endpoints(app: Any, state: State, tasks: set, check_key: Callable[[str | None], None]) -> None:
    """``WS /subscribe`` and ``POST /request`` on ``app``, and the job runner behind them (one job at a time)."""
    from fastapi import HTTPException, Request, Response, WebSocket, WebSocketDisconnect
    from fastapi.responses import JSONResponse
    from ndif.common.schema import BackendRequestModel, BackendResponseModel, Status
    from pydantic import ValidationError

    async def bounded_body(http_request: Request) -> None:
        """Read the body, refusing (413) one over the size limit before reading it whole."""
        limit = state.max_request_bytes
        declared = http_request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPException(413, f"Request too large: {int(declared):,} bytes, the limit is {limit:,} bytes.")
        chunks, size = [], 0
        async for chunk in http_request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"Request too large: over {limit:,} bytes, the limit.")
            chunks.append(chunk)
        http_request._body = b"".join(chunks)  # what .form() parses from here on

    def response_json(job: Job, status: Any, description: str, data: Any = None, meta: Any = None) -> str:
        return BackendResponseModel(id=job.request.id, status=status, description=description, data=data,
                                    meta=meta).model_dump_json()

    async def publish(job: Job, message: str | bytes) -> bool:
        """Send a status to the job's websocket session, or store it for GET /response; False if nobody listens."""
        session = job.request.session_id
        if not session:
            state.responses[job.request.id] = message if isinstance(message, str) else ""
            return True
        queue = state.sessions.get(session)
        if queue is None:
            return False
        done = asyncio.get_running_loop().create_future()
        await queue.put((message, done))
        try:  # bounded: a session that closes right after this put never answers
            return await asyncio.wait_for(done, timeout=60.0)
        except TimeoutError:
            return False

    async def run(job: Job) -> None:
        await publish(job, response_json(job, Status.QUEUED, "Your job has been queued."))
        async with state.run_lock:
            await publish(job, response_json(job, Status.RUNNING, "Your job has started running."))
            started = time.time()
            try:
                blob = await asyncio.to_thread(execute, job)
            except JobFailed as failure:
                exec_seconds = round(time.time() - started, 6)
                await publish(job, response_json(job, Status.ERROR, str(failure), meta={"runtime": exec_seconds}))
                job.finish(status="ERROR", exec_seconds=exec_seconds, error=str(failure).strip().splitlines()[-1])
                return
            except Exception as exception:  # noqa: BLE001 (the server's own failure, not the user's)
                message = f"Loopback NDIF server error: {type(exception).__name__}: {exception}"
                await publish(job, response_json(job, Status.ERROR, message))
                job.finish(status="ERROR", error=message)
                return
        exec_seconds = round(time.time() - started, 6)
        job.record.update(exec_seconds=exec_seconds, result_bytes=len(blob))
        meta = {"runtime": exec_seconds}
        if job.request.session_id and len(blob) <= state.inline_limit:
            frame = BackendResponseModel(id=job.request.id, status=Status.COMPLETED,
                                         description="Your job has been completed.", data=blob, meta=meta).pickle()
            delivered = await publish(job, frame)
            job.finish(status="COMPLETED" if delivered else "UNDELIVERED", transport="inline", wire_bytes=len(frame))
        else:
            state.results[job.request.id] = (blob, job)
            token = result_token(state.api_key, job.request.id)
            url = f"http://127.0.0.1:{state.port}/result/{job.request.id}?token={token}"
            await publish(job, response_json(job, Status.COMPLETED, "Your job has been completed.", url, meta))
            # finished when downloaded (GET /result)

    @app.websocket("/subscribe")
    async def subscribe(websocket: WebSocket) -> None:
        await websocket.accept()
        session = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        state.sessions[session] = queue
        try:
            await websocket.send_json({"session_id": session})
            disconnect = asyncio.ensure_future(websocket.receive())
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return
                message, future = getter.result()
                try:
                    if isinstance(message, bytes):
                        await websocket.send_bytes(message)
                    else:
                        await websocket.send_text(message)
                    future.set_result(True)
                except Exception:  # noqa: BLE001 (any failure to send: the message was not delivered)
                    future.set_result(False)
                    return
        except WebSocketDisconnect:
            return
        finally:
            state.sessions.pop(session, None)
            while not queue.empty():
                _, future = queue.get_nowait()
                if not future.done():
                    future.set_result(False)

    @app.post("/request")
    async def create_request(http_request: Request) -> Response:
        given = http_request.headers.get(API_KEY_HEADER)
        request = None
        try:
            check_key(given)
            check_versions(http_request.headers)
            if state.unavailable > 0:
                state.unavailable -= 1
                raise HTTPException(503, "Service Unavailable: the deployment is restarting (a loopback test fault).")
            await bounded_body(http_request)
            form = await http_request.form()
            try:
                request = BackendRequestModel.model_validate_json(form.get("data") or "")
            except ValidationError as error:
                raise HTTPException(422, f"Malformed request envelope: {error}") from error
            # Server-side fields are the server's: a fresh id (a client cannot pick or collide with one), never
            # trusted, and the key it was checked with.
            request.id = uuid.uuid4().hex
            request.trusted = False
            blob = form.get("blob")
            if blob is None or isinstance(blob, str):
                raise HTTPException(422, "Malformed request: no 'blob' file part.")
            request.payload = await blob.read()
            request.api_key = given
            job = Job(request, _resolve(request.model_key), _float(http_request.headers.get("ndif-timestamp")))
        except HTTPException as error:
            state.remember(make_record(
                id=getattr(request, "id", None), model_key=getattr(request, "model_key", None), status="REJECTED",
                http_status=error.status_code, error=error.detail,
                request_bytes=len(request.payload) if getattr(request, "payload", None) is not None else None,
            ))
            return JSONResponse({"detail": error.detail}, status_code=error.status_code)
        state.remember(job.record)
        body = response_json(job, Status.RECEIVED, "Your job has been received and is waiting to be queued.")
        if not request.session_id:
            state.responses[request.id] = body
        task = asyncio.get_running_loop().create_task(run(job))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return Response(body, media_type="application/json")

    def check_versions(headers: Any) -> None:
        """NDIF's own client gate (``ndif.services.api.versioning``), with ``min_nnsight_version`` as its
        ``NDIF_MIN_NNSIGHT_VERSION``: 400 for a client whose nnsight (its ``nnsight-version`` header) is older."""
        if state.min_nnsight_version:
            from ndif.services.api import versioning

            versioning.MIN_NNSIGHT_VERSION = state.min_nnsight_version
            versioning.validate_client_versions(headers.get("nnsight-version"), headers.get("python-version"))

    def _resolve(model_key: str) -> ServedModel:
        try:
            import_path, data = parse_model_key(model_key)
        except ValueError as error:
            raise HTTPException(422, str(error)) from error
        name = data.get("repo_id")
        model = state.served.get(name)
        if model is None:
            raise HTTPException(
                404, f"Model {name!r} is not hosted by this loopback NDIF server (it serves: "
                f"{', '.join(sorted(state.served))}). Model key: {model_key}",
            )
        wrong = []
        if import_path not in ServedModel.KEY_CLASSES:
            wrong.append(f"wrapper class {import_path}")
        if data.get("task", "text-generation") != "text-generation":
            wrong.append(f"task {data.get('task')!r}")
        if data.get("revision") not in (None, "main"):
            wrong.append(f"revision {data.get('revision')!r}")
        if wrong:
            raise HTTPException(
                400, f"Model {name!r} is served only as {model.model_key}; this request asks for " + ", ".join(wrong)
            )
        return model


def add_query_endpoints(app: Any, state: State, check_key: Callable[[str | None], None]) -> None:
    """The result download, the status of a request, the stats, the test faults and NDIF's informational endpoints."""
    from fastapi import HTTPException, Request, Response
    from starlette.background import BackgroundTask

    @app.get("/result/{request_id}")
    async def get_result(request_id: str, http_request: Request, token: str | None = None) -> Response:
        import hmac

        if token is None or not hmac.compare_digest(token, result_token(state.api_key, request_id)):
            check_key(http_request.headers.get(API_KEY_HEADER))
        entry = state.results.pop(request_id, None)
        if entry is None:
            raise HTTPException(404, f"No result for request {request_id} (unknown, or already downloaded).")
        blob, job = entry

        async def delivered() -> None:
            job.finish(status="COMPLETED", transport="download", wire_bytes=len(blob))

        return Response(blob, media_type="application/octet-stream", background=BackgroundTask(delivered))

    @app.get("/response/{request_id}")
    async def get_response(request_id: str, http_request: Request) -> Response:
        check_key(http_request.headers.get(API_KEY_HEADER))
        body = state.responses.get(request_id)
        if body is None:
            raise HTTPException(404, f"No response for request {request_id}.")
        return Response(body, media_type="application/json")

    @app.get("/stats")
    async def get_stats(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        return {"requests": state.records}

    @app.delete("/stats")
    async def clear_stats(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        state.records.clear()
        return {"cleared": True}

    @app.post("/faults")
    async def set_faults(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        state.unavailable = max(0, int((await http_request.json()).get("unavailable", 0)))
        return {"unavailable": state.unavailable}

    @app.get("/status")
    async def get_status(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        deployments = {
            model.model_key: {
                "model_key": model.model_key, "repo_id": name, "revision": "main", "task": "text-generation",
                "deployment_level": "HOT", "application_state": "RUNNING",
            }
            for name, model in state.served.items()
        }
        return {"deployments": deployments}

    @app.get("/env")
    async def get_env(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        if state.env is None:
            from nnsight.ndif import get_local_env

            state.env = await asyncio.to_thread(get_local_env)
        return state.env

    @app.get("/ping")
    async def ping() -> str:
        return "pong"

    @app.api_route("/connected", methods=["GET", "HEAD"])
    async def connected(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        return {"status": "connected"}

    @app.get("/whoami")
    async def whoami(http_request: Request) -> dict:
        check_key(http_request.headers.get(API_KEY_HEADER))
        return {"email": "loopback@127.0.0.1", "tags": []}


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
