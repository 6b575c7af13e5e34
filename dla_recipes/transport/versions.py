"""The client's nnsight against the NDIF server's, before the first remote request to a server.

A remote trace is serialized by the client's nnsight and rebuilt by the server's; NDIF tells a user whose request
it cannot read to "check that the client and server nnsight versions match" (``ndif.common.errors.PayloadError``),
and can refuse an old client outright (``ndif.services.api.versioning``: ``NDIF_MIN_NNSIGHT_VERSION``, a 400).
``check_versions`` asks the server for its environment (``GET /env``, what ``nnsight.compare()`` reads) once per
server and process, and raises a ``RemoteError`` naming both versions and the fix when they differ; a server that
does not answer ``/env`` is not checked (the request that follows names its own failure).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import nnsight

from ..errors import RemoteError

CHECKED: dict[str, str] = {}  # host -> the server's nnsight version, for the servers this process checked


def client_nnsight() -> str:
    """The nnsight version installed here ("" when it is not installed as a distribution)."""
    try:
        return version("nnsight")
    except PackageNotFoundError:
        return ""


def server_nnsight(host: str) -> str | None:
    """The nnsight version the server at ``host`` runs (its ``/env``), or None when it does not say."""
    import httpx

    key = nnsight.CONFIG.API.APIKEY
    try:
        response = httpx.get(f"{host}/env", headers={"ndif-api-key": key} if key else None, timeout=30.0)
        response.raise_for_status()
        found = response.json().get("packages", {}).get("nnsight")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return str(found) if found else None


def mismatch(client: str, server: str, host: str) -> RemoteError:
    return RemoteError(
        f"this client has nnsight {client or '(not installed as a package)'}, the NDIF server at {host} runs nnsight "
        f"{server}: a trace serialized by one nnsight is not guaranteed to run on the other. Install the server's "
        f"version (pip install nnsight=={server}) and run again; nnsight.compare() lists every package that differs."
    )


def check_versions(remote) -> None:
    """Raise a ``RemoteError`` when the client's nnsight is not the server's (``remote``: True or a URL)."""
    host = remote if isinstance(remote, str) else str(nnsight.CONFIG.API.HOST)
    client = client_nnsight()
    if host not in CHECKED:
        server = server_nnsight(host)
        if server is None:
            return
        CHECKED[host] = server
    if CHECKED[host] != client:
        raise mismatch(client, CHECKED[host], host)
