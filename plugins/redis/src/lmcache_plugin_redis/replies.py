"""Reading RESP2 replies straight off a connection's socket, payloads into their buffers.

redis-py hands a bulk reply over as a ``bytes`` object: with hiredis the reply crosses
three buffers (the socket's chunk, hiredis' own buffer, the ``bytes``) before a load
copies it into the caller's buffer and hashes it once more.  For a 1 MiB payload on this
project's 2-core machine that was ~0.3 ms of the ~0.8 ms a GET took.  Here a load's reply
is parsed as it arrives: the small parts (lengths, the record header) go through a
scratch buffer, and a payload is received with ``recv_into`` directly into the caller's
buffer, each piece hashed right after it landed while it is still in the core's cache.
The header, at the start of the value, is decoded and checked first, so a payload of the
wrong length is never written into a buffer (it is read past), and the caller's ``True``
still comes only after every payload byte matched the header's checksum.

Only what the adapter's commands answer is understood: a bulk string (a lookup's
``GETRANGE``, a load's ``GET``, read whole or piece by piece), an integer (``STRLEN``), a
status (a store's ``SET``), or an error reply (RESP2, which the connections speak).
Anything else is a protocol error, and every socket failure or timeout raises redis-py's
own ``ConnectionError`` / ``TimeoutError``, so the connection is dropped, retried and
counted exactly as for redis-py's commands (so is a ``LOADING`` error: a server still
loading its data set fails the call, not one object).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from redis.exceptions import BusyLoadingError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["ReplyReader"]

#: bytes received at a time into the scratch buffer (small replies, headers, skipped data)
SCRATCH_SIZE = 64 << 10
#: longest line (``*2``, ``$1048576``, an error text) accepted before the reply is refused
#: (half the scratch buffer, so a line being searched always leaves room to receive)
MAX_LINE = SCRATCH_SIZE // 2


class ReplyReader:
    """Replies read in order from the socket :meth:`attach` gave (its timeout set)."""

    __slots__ = ("_end", "_scratch", "_sock", "_start", "_view")

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._scratch = bytearray(SCRATCH_SIZE)
        self._view = memoryview(self._scratch)
        self._start = 0  # unread bytes are scratch[start:end]
        self._end = 0

    def attach(self, sock: socket.socket | None) -> None:
        """Read from ``sock`` (a new connection) from now on, forgetting what is buffered."""
        self._sock = sock
        self._start = self._end = 0

    # -- the socket ---------------------------------------------------------------------------

    def _recv_into(self, view: memoryview) -> int:
        sock = self._sock
        if sock is None:
            raise RedisConnectionError("the connection was closed")
        try:
            got = sock.recv_into(view)
        except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
            raise RedisTimeoutError("Timeout reading from socket") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from socket: {exc}") from exc
        if got == 0:
            raise RedisConnectionError("Connection closed by server.")
        return got

    def _fill(self) -> None:
        """Receive more into the scratch buffer (compacted first when its end is reached)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == SCRATCH_SIZE:
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        self._end += self._recv_into(self._view[self._end :])

    # -- RESP pieces ----------------------------------------------------------------------------

    def _line(self) -> bytes:
        """The next line, without its ``\\r\\n``."""
        searched = 0  # bytes past the start already searched for the line's end
        while True:
            found = self._scratch.find(b"\r\n", self._start + searched, self._end)
            if found >= 0:
                line = bytes(self._view[self._start : found])
                self._start = found + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise InvalidResponse(f"a reply line longer than {MAX_LINE} bytes")
            searched = max(0, self._end - self._start - 1)
            self._fill()

    def _read_into(self, view: memoryview, update: Callable[[memoryview], Any] | None) -> None:
        """Fill ``view`` with the next ``view.nbytes`` bytes; ``update(piece)`` for each
        piece right after it landed."""
        position, length = 0, view.nbytes
        buffered = min(self._end - self._start, length)
        if buffered:
            view[:buffered] = self._view[self._start : self._start + buffered]
            self._start += buffered
            if update is not None:
                update(view[:buffered])
            position = buffered
        while position < length:
            got = self._recv_into(view[position:])
            if update is not None:
                update(view[position : position + got])
            position += got

    def _skip(self, count: int) -> None:
        while count:
            if self._start == self._end:
                self._fill()
            taken = min(count, self._end - self._start)
            self._start += taken
            count -= taken

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if not self._scratch.startswith(b"\r\n", self._start):
            raise InvalidResponse("a bulk string does not end with CRLF")
        self._start += 2

    # -- replies ------------------------------------------------------------------------------

    def bulk_reply(self) -> bytes | ResponseError | None:
        """The next reply, a bulk string (None for nil), or its error."""
        length = self.bulk_start()
        if isinstance(length, ResponseError) or length < 0:
            return None if isinstance(length, int) else length
        data = self.part(length)
        self.end_bulk()
        return data

    def integer_reply(self) -> int | ResponseError:
        """The next reply, an integer, or its error."""
        line = self._line()
        if line[:1] == b"-":
            return _error(line)
        if line[:1] != b":":
            raise InvalidResponse(f"expected an integer reply, got {line[:32]!r}")
        try:
            return int(line[1:])
        except ValueError:
            raise InvalidResponse(f"bad integer in reply line {line[:32]!r}") from None

    def status_reply(self) -> str | ResponseError:
        """The next reply, a status (``OK``), or its error."""
        line = self._line()
        if line[:1] == b"-":
            return _error(line)
        if line[:1] != b"+":
            raise InvalidResponse(f"expected a status reply, got {line[:32]!r}")
        return line[1:].decode("utf-8", "replace")

    def bulk_start(self) -> int | ResponseError:
        """The length of the next reply, a bulk string (-1 for nil), or its error; its
        bytes are then read in parts (``part``, ``part_into``, ``skip_part``) and its end
        by ``end_bulk``."""
        line = self._line()
        if line[:1] == b"-":
            return _error(line)
        if line[:1] != b"$":
            raise InvalidResponse(f"expected a bulk string reply, got {line[:32]!r}")
        return _number(line)

    def part(self, length: int) -> bytes:
        """The next ``length`` bytes of the bulk string being read."""
        data = bytearray(length)
        self._read_into(memoryview(data), None)
        return bytes(data)

    def part_into(self, view: memoryview, update: Callable[[memoryview], Any]) -> None:
        """The next ``view.nbytes`` bytes of the bulk string being read, into ``view``, each
        piece passed to ``update`` as it lands."""
        self._read_into(view, update)

    def skip_part(self, length: int) -> None:
        """Read past the next ``length`` bytes of the bulk string being read."""
        self._skip(length)

    def end_bulk(self) -> None:
        """The end of the bulk string whose last byte was just read."""
        self._crlf()


def _error(line: bytes) -> ResponseError:
    """An error reply about one command; raises when it says the store cannot serve any
    (a server still loading its data set: a failed call, as redis-py treats it)."""
    text = line[1:].decode("utf-8", "replace")
    if text.startswith("LOADING "):
        raise BusyLoadingError(text)
    return ResponseError(text)


def _number(line: bytes) -> int:
    try:
        value = int(line[1:])
    except ValueError:
        raise InvalidResponse(f"bad length in reply line {line[:32]!r}") from None
    if value < -1:
        raise InvalidResponse(f"bad length in reply line {line[:32]!r}")
    return value
