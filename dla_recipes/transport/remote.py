"""Remote (NDIF) runs: ship the package by value, name the cause of a failure, retry what is transient.

``attribute(..., remote=..., batch_size=k)`` sends one request per batch. This module decides what a failed request
means and what to do about it:

- a **transient** failure (the server unreachable or restarting, a connection dropped, an HTTP 5xx such as 503
  Service Unavailable, a timeout) is retried up to ``RETRIES`` times, waiting ``BACKOFF_S * 2**attempt`` seconds;
- anything else (a wrong or missing API key, a model the server does not host, an exception inside the trace on the
  server) fails at once with a ``RemoteError`` naming the cause, since sending it again would fail again;
- when request ``k`` of ``n`` still fails, the requests that completed are not lost: ``RemoteBatchError.partial``
  holds their attribution (self-checked), and, when the failure is transient (``is_transient``: the server may come
  back), ``RemoteBatchError.resume()`` sends only the requests not done yet and returns the whole attribution, in the
  prompts' order. A failure no retry fixes offers no ``resume()``; on the first request it raises its own
  ``RemoteError``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import nnsight

from ..errors import DLAError, RemoteError

RETRIES = 2  # extra tries of a request after a transient failure (so at most 3 sends)
BACKOFF_S = 0.5  # wait before retry ``attempt`` (0, 1, ...): BACKOFF_S * 2**attempt seconds


class RemoteBatchError(RemoteError):
    """Request ``failed_batch`` of a remote ``attribute`` failed after the earlier ones completed.

    Attributes:
        partial: the ``Attribution`` of the prompts whose requests completed (self-checked, in the prompts' order),
            or None when the first request failed.
        done: the indices (into the prompts given to ``attribute``) that ``partial`` covers.
        failed_batch: the index of the request that failed; ``cause``: its ``RemoteError``.

    ``resumable``: whether the failure was transient (server unreachable, HTTP 5xx, a timeout), so that sending the
    request again may succeed. Then ``resume()`` sends the requests not done yet (with the same arguments) and returns
    the whole ``Attribution``; if one fails again it raises a new ``RemoteBatchError`` that keeps everything done so
    far. A failure that would happen again (a model the server does not host, a refused key, an exception in the
    trace) is not resumable: ``resume()`` raises a ``RemoteError`` saying so.
    """

    def __init__(self, message: str, partial, done: tuple[int, ...], failed_batch: int, cause: RemoteError,
                 resume: Callable | None):
        super().__init__(message)
        self.partial, self.done, self.failed_batch, self.cause = partial, done, failed_batch, cause
        self._resume = resume

    @property
    def resumable(self) -> bool:
        """Whether ``resume()`` may succeed: the failure was transient."""
        return self._resume is not None

    def resume(self):
        """Send the remaining requests and return the attribution of every prompt (a transient failure only)."""
        if self._resume is None:
            raise RemoteError(
                f"request {self.failed_batch + 1} failed for a reason no retry fixes ({self.cause}); there is "
                "nothing to resume: fix its cause and attribute the prompts not in .done again"
            )
        return self._resume()


def register_for_remote() -> None:
    """Ship dla_recipes by value: an NDIF server has nnsight and torch, not this package (the package is loaded:
    this module is part of it)."""
    nnsight.register(sys.modules[__name__.partition(".")[0]])


def remote_host(remote) -> str:
    return remote if isinstance(remote, str) else str(nnsight.CONFIG.API.HOST)


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _http_status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None) or getattr(error, "status_code", None)
    return int(status) if isinstance(status, int) else None


def is_transient(error: BaseException) -> bool:
    """Whether sending the same request again may succeed: no connection, a dropped one, a timeout, an HTTP 5xx."""
    for link in _chain(error):
        status = _http_status(link)
        if status is not None:
            return status >= 500
        if isinstance(link, (ConnectionError, TimeoutError)):
            return True
        name = type(link).__name__
        if name in ("ConnectError", "ReadError", "WriteError", "RemoteProtocolError", "ConnectTimeout",
                    "ReadTimeout", "WriteTimeout", "PoolTimeout", "WebSocketConnectionClosedException",
                    "WebSocketTimeoutException"):
            return True
        text = str(link)
        if "503" in text and "Service Unavailable" in text or "Connection refused" in text:
            return True
    return False


def _reached_server(error: BaseException) -> bool:
    """Whether a failed remote run got an answer from the server (nnsight's ``RemoteError``, an HTTP or websocket
    error) rather than failing on the client (building the model key, serializing the trace, a bad host URL)."""
    from nnsight.intervention.backends.remote import RemoteError as ServerError

    if any(_http_status(link) is not None for link in _chain(error)):
        return True
    module = type(error).__module__.split(".")[0]
    return isinstance(error, (ServerError, OSError)) or module in ("httpx", "websocket", "socketio", "engineio")


def remote_error(error: BaseException, remote) -> RemoteError:
    """A ``RemoteError`` naming the cause of a failed remote run: key, host, model, or the server-side exception."""
    if isinstance(error, RemoteError):
        return error
    host = remote_host(remote)
    text = str(error).strip() or type(error).__name__
    if isinstance(error, (ConnectionError, TimeoutError)) or "Connection refused" in text:
        return RemoteError(f"cannot reach the NDIF server at {host}: {text}. Is the host right and the server up?")
    if not _reached_server(error):  # failed here, before a request reached the server: not a server failure
        hint = ""
        if "Repo id must be in the form" in text:
            hint = (" (a remote model is named by the hub id the server hosts: load it with "
                    "dla_recipes.load('org/name', remote=True), not from a local folder)")
        return RemoteError(
            f"the remote run failed on this machine, before the NDIF server at {host} ran it: "
            f"{type(error).__name__}: {text}{hint}"
        )
    if "API key" in text or "api key" in text.lower():
        return RemoteError(
            f"the NDIF server at {host} refused the API key: {text}. Set NDIF_API_KEY (or nnsight.CONFIG.API.APIKEY)."
        )
    if "Client nnsight version" in text or "Malformed nnsight version" in text:  # ndif's own gate (versioning.py)
        return RemoteError(
            f"the NDIF server at {host} refused this client's nnsight: {text} (installed here: nnsight "
            f"{nnsight.__version__}). Upgrade it to the server's version (nnsight.compare() shows both) and run again."
        )
    if "not hosted" in text or "not running" in text or "not deployed" in text:
        return RemoteError(f"the NDIF server at {host} does not host this model: {text}")
    if is_transient(error):
        return RemoteError(f"the NDIF server at {host} is unavailable: {text.rstrip('.')}. Try again later.")
    cause = [line for line in text.splitlines() if line.strip()][-1].strip()
    return RemoteError(f"the remote trace failed on the NDIF server at {host}: {cause}\n\nServer traceback:\n{text}")


def retry_or_raise(error: BaseException, attempt: int, remote, retries: int | None = None,
                   sleep: Callable = time.sleep) -> int:
    """After try ``attempt`` (0, 1, ...) of a remote trace failed with ``error``: wait and return ``attempt + 1`` when
    the failure is transient and tries are left, else raise a ``RemoteError`` naming the cause.

    The caller keeps the trace in its own frame (nnsight reads a trace's code from the frame that holds it)::

        attempt = 0
        while True:
            try:
                with model.trace(..., remote=remote): ...
                break
            except Exception as error:
                attempt = retry_or_raise(error, attempt, remote)
    """
    retries = RETRIES if retries is None else retries
    if isinstance(error, DLAError) and not isinstance(error, RemoteError):
        raise error  # the client's own verdict (bad input, an inexact result): never retried or re-worded
    if attempt < retries and is_transient(error):
        sleep(BACKOFF_S * 2 ** attempt)
        return attempt + 1
    raise remote_error(error, remote) from error
