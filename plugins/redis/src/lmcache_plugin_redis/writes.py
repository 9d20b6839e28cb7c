"""Stores of a standalone store on the thread's own connection (direct.py), checksums
taken while the store is busy.

A store trip is sent, then its replies waited for; most of that wait is the store reading
the bytes still in the socket, while the client has nothing to do.  Each record's header
holds its payload's checksum (XXH3-128, ~0.08 ms a MiB read from memory) and goes before
its payload (``SET name <header><payload>``, records.py), so it is taken where the client
would otherwise wait:

- the header of each record of a trip but its first is taken after the payload before it
  is in the socket, while the store reads that payload;
- the headers of the next trip are taken while this trip's replies are waited for.

redis-py's pipeline sends and waits in one call, so this is done here (on a cluster,
stores keep redis-py's pipeline, which follows slot moves).  Each SET is sent as its small
parts, the header and the payload's own buffer: nothing is joined with the payload,
nothing copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_plugin_redis.direct import DirectConnections, Send
from lmcache_plugin_redis.replies import ReplyReader
from lmcache_tiers.plugin import BackendContext, ObjectKey

__all__ = ["RecordHeaders", "RecordTrip", "write_records"]

#: ``SET <name>`` and the value's length line, packed (the header, then the payload follow)
_SET_RECORD = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
#: the longest record header core makes (its ``MAX_HEADER_LEN``; a longer one is refused)
HEADER_BOUND = 1 << 16
#: the checksum a header is checked with (``RecordHeaders.check``), never stored
_UNTAKEN = bytes(16)


class RecordHeaders:
    """The record headers of one store call, each taken once: by the trip before its own
    (``ahead``), or by its own trip; a trip sent again after a dropped connection reuses them."""

    __slots__ = ("_context", "_header_lengths", "_headers", "_keys", "_payloads")

    def __init__(
        self, context: BackendContext, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]
    ) -> None:
        self._context = context
        self._keys = keys
        self._payloads = payloads
        self._headers: dict[int, bytes] = {}
        #: header lengths measured without a checksum (``value_length``), each once
        self._header_lengths: dict[int, int] = {}

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

    def value_length(self, index: int) -> int:
        """How long the value of ``index`` is, header and payload -- what the store's limits
        hold it against.  The header's length does not depend on the checksum, so it is
        measured without one; a header that cannot be made counts as none here (its own
        trip fails on it, as ``check`` says)."""
        payload = self._payloads[index]
        header = self._headers.get(index)
        if header is not None:
            return len(header) + payload.nbytes
        length = self._header_lengths.get(index)
        if length is None:
            try:
                length = len(self._context.record_header(self._keys[index], payload, digest=_UNTAKEN))
            except Exception:  # raised again, in its own trip, by ``check``
                length = 0
            self._header_lengths[index] = length
        return length + payload.nbytes

    def surely_within(self, index: int, limit: int) -> bool:
        """Whether the value of ``index`` is within ``limit`` bytes whatever its header's
        length (at most ``HEADER_BOUND``): nothing to measure for nearly every object."""
        return self._payloads[index].nbytes + HEADER_BOUND <= limit

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
    """SET the records ``batch`` indexes (``names[i]``, ``payloads[i]``); the headers of
    ``upcoming`` (the next trip) are taken before this trip's replies are read.  The
    replies, in order: each ``OK``, or the store's error reply about that command."""
    for index in batch:
        headers.check(index)
    end = b""
    for index in batch:
        name, payload = names[index], payloads[index]
        # Taken (when not ahead) while the store reads the payload sent just before.
        header = headers.of(index)
        send(end + _SET_RECORD % (len(name), name, len(header) + payload.nbytes) + header)
        send(payload)
        end = b"\r\n"
    send(end)
    headers.ahead(upcoming)
    return [reader.status_reply() for _ in batch]


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
