"""What both sides of the loopback NDIF server share: the key header, the defaults, the ready line, result tokens.

Imports only the standard library: the client side (``server``, ``client``) and the server process (``main``,
``app``, ``handlers``, ``jobs``) both use it.
"""

from pathlib import Path

API_KEY_HEADER = "ndif-api-key"
API_KEY_ENV = "LOOPBACK_NDIF_API_KEY"  # how the Python API hands the key to the server (not on the command line)
DEFAULT_INLINE_LIMIT = 8 * 1024 * 1024  # NDIF's stock Redis pubsub soft limit: larger results go through a download
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # a DLA request is 30-50 KB; anything near this is not one
DEFAULT_BLOCKED_IMPORTS = ("dla_recipes", "nnterp")
READY_PREFIX = "LOOPBACK_NDIF_READY"
MAX_RECORDS = 10_000
# The file the server process runs by path (``python -P <it>``), so that nothing of ``dla_recipes`` is imported there.
SERVER_SCRIPT = Path(__file__).resolve().with_name("__main__.py")


def result_token(api_key: str, request_id: str) -> str:
    """The presigned-URL token of a result: an HMAC of the request id under the server's key."""
    import hashlib
    import hmac

    return hmac.new(api_key.encode(), request_id.encode(), hashlib.sha256).hexdigest()
