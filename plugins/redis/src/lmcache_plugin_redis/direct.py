"""Connections of a standalone store on which lookups and loads parse their own replies.

Each worker thread keeps one connection of its own for the calls whose replies
:class:`~lmcache_plugin_redis.replies.ReplyReader` parses: it is built by redis-py (same
class, credentials, database, TLS and timeouts as the pool's, so connecting and
authenticating stay redis-py's), but taking it from redis-py's pool and giving it back,
plus redis-py's command packing, cost ~0.1 ms of a 1 MiB load that takes ~0.7 ms.
The commands are packed here (a few short arguments each) and written with one
``sendall``.  The connection of a thread that ended is closed when the next thread
makes its own.

A failed call drops its connection (its stream may stop inside a reply) and is tried
again once on a new one, as redis-py's own ``Retry(NoBackoff(), 1)`` does; ``close``
shuts every connection, which also ends a call waiting on a store that stopped
answering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from lmcache_plugin_redis.replies import ReplyReader

__all__ = ["DirectConnections", "Send", "pack_command"]

T = TypeVar("T")
#: writes packed commands (or a payload, a buffer of its own) to a call's connection
Send = Callable[[bytes | memoryview], None]
#: failures after which a call is tried once more on a new connection
_RETRIED = (RedisConnectionError, RedisTimeoutError)


def pack_command(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n" % len(arg))
        parts.append(arg)
        parts.append(b"\r\n")
    return b"".join(parts)


class _Lane:
    """One thread's connection and the reader of its replies."""

    __slots__ = ("connection", "owner", "reader")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.reader = ReplyReader()
        #: the thread whose calls use it (no other thread ever does)
        self.owner = threading.current_thread()

    def socket(self) -> Any:
        connection = self.connection
        if connection._sock is None:
            connection.connect()
            self.reader.attach(connection._sock)
        return connection._sock

    def drop(self) -> None:
        self.connection.disconnect()
        self.reader.attach(None)


class DirectConnections:
    """A connection per calling thread to the store behind ``client``'s pool."""

    def __init__(self, client: Redis) -> None:
        pool = client.connection_pool
        # The connection itself never retries (redis-py's would connect and authenticate
        # a second time even after close() shut its socket): call() is the one retry.
        # RESP2 whatever the url asks (redis-py takes `?protocol=3` from it): the reply
        # reader parses RESP2 only.
        options = {**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0), "protocol": 2}
        self._make: Callable[[], Any] = lambda: pool.connection_class(**options)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        self._closed = False

    def _lane(self) -> _Lane:
        lane: _Lane | None = getattr(self._local, "lane", None)
        if lane is None:
            with self._lock:
                if self._closed:
                    raise RedisConnectionError("the adapter is closing")
                # Some calls come from threads that end right after (the L2 eviction runs
                # each delete, and the lookup asking whether its keys are gone, on a thread
                # of its own): their connections are closed here, or one per such thread
                # would stay open until the store refuses new clients.
                ended = [old for old in self._lanes if not old.owner.is_alive()]
                self._lanes = [old for old in self._lanes if old.owner.is_alive()]
                lane = _Lane(self._make())
                self._lanes.append(lane)
            for old in ended:
                old.drop()
            self._local.lane = lane
        return lane

    def call(self, work: Callable[[Send, ReplyReader], T]) -> T:
        """``work(send, reader)`` on this thread's connection: ``send`` writes packed
        commands, ``reader`` reads their replies.  Retried once on a new connection after
        a connection error or timeout; any failure drops the connection."""
        lane = self._lane()

        def send(packed: bytes | memoryview) -> None:
            sock = lane.socket()
            try:
                sock.sendall(packed)
            except TimeoutError:
                raise RedisTimeoutError("Timeout writing to socket") from None
            except OSError as exc:
                raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc

        for attempt in (1, 2):
            try:
                lane.socket()
                return work(send, lane.reader)
            except _RETRIED:
                lane.drop()
                if attempt == 2 or self._closed:
                    raise
            except BaseException:
                lane.drop()
                raise
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def close(self) -> None:
        """Shut every connection (a thread's next call opens a new one, unless closed)."""
        with self._lock:
            lanes = list(self._lanes)
        for lane in lanes:
            lane.connection.disconnect()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self.close()
