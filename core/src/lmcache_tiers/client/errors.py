"""Exceptions the client raises; all derive from :class:`ClientError`."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_tiers.errors import TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p


class ClientError(TiersError):
    """Base class of every error the client raises."""


class RequestTimeoutError(ClientError, TimeoutError):
    """The server did not answer in time (not running, overloaded, or unreachable)."""


class ConnectionLostError(RequestTimeoutError):
    """The connection to the server dropped while a request waited for its reply (the
    server stopped, died or restarted): no reply can come.  A kind of timeout, raised
    early, so a caller that handles timeouts handles this too."""


class ProtocolError(ClientError):
    """The server answered something this client cannot understand."""


class ServerError(ClientError):
    """The server answered with an error code."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.server_message = message


class StaleReadError(ClientError):
    """Objects whose extents changed hands while this client read them (its lease was
    broken by a forced clear or outlived by the lock TTL): the bytes read for ``keys``
    may belong to other objects and must not be used."""

    def __init__(self, keys: Sequence[ObjectKey]) -> None:
        first = keys[0]
        super().__init__(
            f"the bytes of {len(keys)} retrieved objects may have changed while they were held "
            f"(first: model {first.model_name!r}, chunk {first.chunk_hash.hex()[:16]}); "
            "their lease ended early (a forced clear, or held past the lock TTL): retrieve them again"
        )
        self.keys = list(keys)


def error_code(value: int) -> p.ErrorCode:
    try:
        return p.ErrorCode(value)
    except ValueError:
        return p.ErrorCode.INTERNAL
