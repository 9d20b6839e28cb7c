"""Helpers shared by the native front end's write-fence tests: a writer stalled or cut off
between its check of its slots and its copy, and an L1 clock driven past the write TTL."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from native_stop import wait_for

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer

CHUNK = 256 << 10


def read(client: Client, key: ObjectKey) -> bytes:
    assert client.lookup([key]) == 1
    with client.retrieve([key]) as views:
        return bytes(views[0])


def outlive_write_ttl(server: TiersServer) -> None:
    """What a writer stalled mid-copy lives through: its reservation is reaped at the write
    TTL, and the grace period of that expired lock ends."""
    l1 = server.storage.l1
    expiry = time.monotonic() + l1.write_ttl_s + 1
    l1.expire_locks(expiry)
    l1.expire_locks(expiry + l1.lease_grace_s + 1)


def stall_before_copy(client: Client, monkeypatch: pytest.MonkeyPatch, stall: Any) -> None:
    """Run ``stall()`` after the client checked its slots' generations, before its copy."""
    segment = client._segment
    assert segment is not None, "the client did not map the server's arena"
    copy = segment.write_many

    def stalled_copy(copies: Sequence[tuple[int, np.ndarray[Any, Any]]]) -> None:
        stall()
        copy(copies)

    monkeypatch.setattr(segment, "write_many", stalled_copy)


#: a write TTL short enough for the server's own sweep and reap to expire a reservation
SHORT_TTL = {"l1_write_ttl_s": 1.0, "l1_lock_ttl_s": 1.0}


class CuttableLink:
    """A TCP relay to the server whose connections the test cuts: the client sees a real
    drop, reconnects, and the server sees it under a new ZeroMQ identity (a peer without a
    routing id of its own gets a new one per connection)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host.strip("[]"), int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return
            far = socket.create_connection(self._target)
            self._pairs.append((near, far))
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        for pair in self._pairs:
            for end in pair:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        self.cut()


def drop_before_copy(writer: Client, link: CuttableLink, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut the writer's connection after its check of its slots, before its copy, and let
    the copy go on once the client has connected again (a new identity to the server)."""

    def back() -> bool:
        with writer._lock:
            writer._read_link_events()
            return writer._dropped and not writer._unlinked

    def drop() -> None:
        link.cut()
        wait_for(back, "the client dropped and connected again")

    stall_before_copy(writer, monkeypatch, drop)
