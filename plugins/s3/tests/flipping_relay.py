"""A TCP relay on loopback in front of the test S3 server that can flip one byte of what
the server sends -- damage on the way, as a faulty link or middlebox makes it, to an object
that is intact in the store -- or of what the client sends: an upload damaged on its way
to the store."""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from urllib.parse import urlsplit

_CHUNK = 64 << 10


class FlippingRelay:
    """Relays every connection to ``endpoint``; :meth:`flip_once` arms it."""

    def __init__(self, endpoint: str) -> None:
        target = urlsplit(endpoint)
        self._target = (target.hostname or "127.0.0.1", target.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        #: bytes still to pass untouched before the one flipped; None: off
        self._flip_after: int | None = None
        #: what must be sent first, the bytes above counted from its start
        self._marker: bytes | None = None
        #: whose bytes are flipped: the server's (a read) or the client's (an upload)
        self._from_server = True
        #: bytes flipped so far (a test checks it did its part)
        self.flipped = 0
        threading.Thread(target=self._accept, name="flipping-relay", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def flip_once(self, after: int, marker: bytes | None = None, *, upload: bool = False) -> None:
        """Flip the byte the server sends ``after`` bytes from now -- or from the start of
        the first ``marker`` it sends -- on any connection; with ``upload``, the byte the
        client sends instead."""
        with self._lock:
            self._flip_after = after
            self._marker = marker
            self._from_server = not upload

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _end(sock)

    def __enter__(self) -> FlippingRelay:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _address = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                _end(client)
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink, from_server in ((client, upstream, False), (upstream, client, True)):
                pump = threading.Thread(target=self._pump, args=(source, sink, from_server), daemon=True)
                pump.start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        try:
            while chunk := source.recv(_CHUNK):
                sink.sendall(self._passed(chunk, from_server))
        except OSError:
            pass
        finally:  # either side gone: the connection is over both ways
            _end(source)
            _end(sink)

    def _passed(self, chunk: bytes, from_server: bool) -> bytes:
        with self._lock:
            after = self._flip_after
            if after is None or from_server != self._from_server:
                return chunk
            if self._marker is not None:
                found = chunk.find(self._marker)
                if found < 0:
                    return chunk
                self._marker = None
                after += found
            if after >= len(chunk):
                self._flip_after = after - len(chunk)
                return chunk
            self._flip_after = None
            self.flipped += 1
        damaged = bytearray(chunk)
        damaged[after] ^= 0xFF
        return bytes(damaged)


def _end(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
