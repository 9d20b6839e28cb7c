"""Stores of a standalone store on the thread's own connection (direct.py), checksums
taken while the store is busy.

A store trip is sent, then its replies waited for; most of that wait is the store reading
and copying the bytes still in the socket (~3 ms of an 8 MiB trip on this project's 2-core
machine), while the client has nothing to do.  Each record's header holds its payload's
checksum (XXH3-128, ~0.08 ms a MiB read from memory), taken where the client would wait:

- the header is the last field of its ``HSET name p <payload> h <header>`` (a hash's
  fields have no order), so a record's checksum is taken after its payload is in the
  socket, while the store reads it: sending 1 MiB takes the client ~0.14 ms, the store
  ~0.35 ms more to read it, and a store of one object no longer waits for its checksum;
- the headers of the next trip are taken while this trip's replies are waited for.

redis-py's pipeline sends and waits in one call, so this is done here (on a cluster,
stores keep redis-py's pipeline, which follows slot moves).  Each HSET is sent as its
small parts and the payload's own buffer: nothing is joined with the payload, nothing
copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_plugin_redis.direct import DirectConnections, Send
from lmcache_plugin_redis.replies import ReplyReader
from lmcache_tiers.plugin import BackendContext, ObjectKey

__all__ = ["RecordHeaders", "RecordTrip", "write_records"]

#: ``HSET <name> p`` and the payload's length line, packed (its bytes follow)
_HSET_PAYLOAD = b"*6\r\n$4\r\nHSET\r\n$%d\r\n%s\r\n$1\r\np\r\n$%d\r\n"
#: the end of the payload, and the ``h <header>`` field that ends the HSET
_HEADER_FIELD = b"\r\n$1\r\nh\r\n$%d\r\n%s\r\n"
#: the checksum a header is checked with (``RecordHeaders.check``), never stored
_UNTAKEN = bytes(16)


class RecordHeaders:
    """The record headers of one store call, each taken once: by the trip before its own
    (``ahead``), or by its own trip; a trip sent again after a dropped connection reuses them."""

    __slots__ = ("_context", "_headers", "_keys", "_payloads")

    def __init__(
        self, context: BackendContext, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]
    ) -> None:
        self._context = context
        self._keys = keys
        self._payloads = payloads
        self._headers: dict[int, bytes] = {}

    def of(self, index: int) -> bytes:
        header = self._headers.get(index)
        if header is None:
            header = self._context.record_header(self._keys[index], self._payloads[index])
            self._headers[index] = header
        return header

    def check(self, index: int) -> None:
        """Raise now what taking the header of ``index`` would raise (a key or serde chain
        it cannot hold, a header too long: none depends on the checksum), without taking
        the checksum -- a few microseconds.  A trip checks its records before its first
        byte is sent: a header failing after its payload was sent would leave the records
        before it in the trip complete, so stored, and reported failed."""
        if index not in self._headers:
            self._context.record_header(self._keys[index], self._payloads[index], digest=_UNTAKEN)

    def ahead(self, indices: Sequence[int]) -> None:
        """Take the headers of ``indices`` now.  One that cannot be made (a header too
        long ...) is left for its own trip to fail on, as it did before: raised here, it
        would fail the trip whose replies are being waited for, whose records are stored."""
        for index in indices:
            try:
                self.of(index)
            except Exception:  # raised again by ``of`` in its own trip
                return


def write_records(
    send: Send,
    reader: ReplyReader,
    names: Mapping[int, bytes],
    payloads: Sequence[memoryview],
    headers: RecordHeaders,
    batch: Sequence[int],
    upcoming: Sequence[int],
) -> list[Any]:
    """HSET the records ``batch`` indexes (``names[i]``, ``payloads[i]``); the headers of
    ``upcoming`` (the next trip) are taken before this trip's replies are read.  The
    replies, in order: each an integer, or the store's error reply about that command."""
    for index in batch:
        headers.check(index)
    tail = b""
    for index in batch:
        name, payload = names[index], payloads[index]
        send(tail + _HSET_PAYLOAD % (len(name), name, payload.nbytes))
        send(payload)
        # Taken (when not ahead) while the store reads the payload just sent.
        header = headers.of(index)
        tail = _HEADER_FIELD % (len(header), header)
    send(tail)
    headers.ahead(upcoming)
    return [reader.integer_reply() for _ in batch]


class RecordTrip:
    """A store trip on a standalone store, run as redis-py's pipeline is (``execute``) so
    that the backend handles its replies, and its failures, as a pipeline's."""

    __slots__ = ("_batch", "_direct", "_headers", "_names", "_payloads", "_upcoming")

    def __init__(
        self,
        direct: DirectConnections,
        names: Mapping[int, bytes],
        payloads: Sequence[memoryview],
        headers: RecordHeaders,
        batch: Sequence[int],
        upcoming: Sequence[int],
    ) -> None:
        self._direct = direct
        self._names = names
        self._payloads = payloads
        self._headers = headers
        self._batch = batch
        self._upcoming = upcoming

    def execute(self, *, raise_on_error: bool = True) -> list[Any]:
        """The trip's replies (sent once more on a new connection after a connection error
        or timeout, as redis-py's pipeline is); an error reply raised unless
        ``raise_on_error`` is false, as redis-py's pipeline does."""
        replies = self._direct.call(self._write)
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        if raise_on_error and errors:
            raise errors[0]
        return replies

    def _write(self, send: Send, reader: ReplyReader) -> list[Any]:
        return write_records(
            send, reader, self._names, self._payloads, self._headers, self._batch, self._upcoming
        )
