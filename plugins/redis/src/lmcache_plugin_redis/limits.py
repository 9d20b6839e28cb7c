"""What a Redis or Valkey store takes in one command, as ``CONFIG GET`` reads it.

A string longer than the store's ``proto-max-bulk-len``, or an argument longer than its
``client-query-buffer-limit`` holds, makes the store close the connection -- failing every
other command pipelined on it -- so the adapter refuses such an object before sending it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from redis import Redis
from redis.exceptions import ResponseError

#: Redis's default ``proto-max-bulk-len``: the limit assumed where CONFIG GET is refused
DEFAULT_BULK_LIMIT = 512 << 20
#: Redis's default ``client-query-buffer-limit``: assumed where CONFIG GET is refused
DEFAULT_QUERY_BUFFER_LIMIT = 1 << 30
#: what Redis holds in a client's query buffer besides a long argument: the CRLF after
#: it (an argument of 32 KiB or more is read into the buffer alone, and a buffer over
#: ``client-query-buffer-limit`` makes Redis close the connection)
QUERY_BUFFER_FRAMING = 2


class StoreLimits(NamedTuple):
    """A store's ``proto-max-bulk-len`` (the longest string a command may send) and
    ``client-query-buffer-limit`` (the most a client's query buffer may hold)."""

    bulk: int
    query_buffer: int

    @property
    def longest_value(self) -> int:
        """The longest payload the store takes in one command."""
        return min(self.bulk, self.query_buffer - QUERY_BUFFER_FRAMING)


def default_limits() -> StoreLimits:
    """Redis's defaults (read when called: tests lower them)."""
    return StoreLimits(DEFAULT_BULK_LIMIT, DEFAULT_QUERY_BUFFER_LIMIT)


def read_limits(nodes: Sequence[Redis]) -> tuple[StoreLimits, bool]:
    """The lowest limits of ``nodes`` (a store, or a cluster's primaries), and whether
    any was assumed: a node that refuses CONFIG GET (an ACL, a renamed or disabled
    command) is taken at Redis's default, not left out of the minimum -- a higher limit
    read elsewhere would let through objects it drops the connection for.  Raises when
    a node does not answer."""
    defaults = default_limits()
    lowest: list[int] = []
    assumed = False
    for parameter, default in zip(("proto-max-bulk-len", "client-query-buffer-limit"), defaults, strict=True):
        values = [_config_value(node, parameter) for node in nodes]
        assumed = assumed or None in values
        lowest.append(min((default if value is None else value for value in values), default=default))
    return StoreLimits(*lowest), assumed


def _config_value(client: Redis, parameter: str) -> int | None:
    """The store's value of the numeric ``parameter``; None where CONFIG GET is refused."""
    try:
        reply = client.config_get(parameter)
    except ResponseError:  # NoPermissionError too
        return None
    values = [value for value in reply.values() if value is not None]
    return int(values[0]) if values else None
