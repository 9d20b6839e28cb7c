"""The fence of a relayed writer that exited before its connection's lookup ran.

Behind a relay the kernel names no writer (the relay maps no arena), and the process the
client's HELLO pid names -- pinned by a pidfd at the connection's first request -- stands
in once it is seen to map the arena.  That was asked only after the connection's scan,
which starts ``SCAN_DELAY_S`` (5 ms) after that request, waits behind the scans of other
connections, and itself takes up to tens of milliseconds: a writer that died holding its
reservation in that time had no maps left to read, so nothing stood in for it, its pid
named nothing, and its expired reservation stayed fenced until the server stopped.

Every process here is a real one: the relay (mapping no arena) and the writer (mapping
the arena, as clients do).  The relay keeps its connection to the server open when its
client goes, as one pooling its connections does (one passing the close on has the
client's socket seen gone with the pinned process, which stands in then).  The scan is
held until the writer has exited; the sweeps that give fences back until the reservation
is fenced.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

import pytest
from native_fence_support import SHORT_TTL
from native_keys import leases_of
from native_stop import wait_for
from test_fence_waits_for_the_writer_known_at_reservation import (
    HeldSweeps,
    fenced,
    found_not_writer,
    native,
    writer_reserved_through,
)

from lmcache_tiers.peer_process import PeerProcess, PeerSocket
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.children import end

#: relays every connection to 127.0.0.1:argv[1] from a port of its own, which it prints,
#: and keeps the connection to the server open once its client's closes
KEEPING_RELAY = """
import socket, sys, threading
target = int(sys.argv[1])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
def pump(source, sink):
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
while True:
    near, _ = listener.accept()
    far = socket.create_connection(("127.0.0.1", target))
    for a, b in ((near, far), (far, near)):
        threading.Thread(target=pump, args=(a, b), daemon=True).start()
"""


class HeldScans:
    """The connections' scans, each held at its start until :meth:`let_go`."""

    def __init__(self, server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> None:
        writers = native(server).handlers.writers
        scan = writers.scan
        self.started = threading.Event()
        self._free = threading.Event()

        def held(peer: PeerSocket) -> PeerProcess | None:
            self.started.set()
            assert self._free.wait(60), "the scan was never let go"
            return scan(peer)

        monkeypatch.setattr(writers, "scan", held)

    def let_go(self) -> None:
        self._free.set()


def test_a_relayed_writer_gone_before_its_lookup_ran_has_its_fence_lifted(
    make_server: Callable[..., TiersServer],
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server(**SHORT_TTL)
    sweeps = HeldSweeps(server, monkeypatch)
    scans = HeldScans(server, monkeypatch)
    writer, identity, _ = writer_reserved_through(KEEPING_RELAY, server, processes)
    assert scans.started.wait(30), "the connection's lookup never began"
    end(writer)  # dies holding its reservation, its connection's lookup not run yet
    scans.let_go()
    wait_for(lambda: found_not_writer(server, bytes.fromhex(identity)), "the relay found, not the writer")
    wait_for(lambda: fenced(server) == 1, "the expired reservation fenced")
    sweeps.let_go()
    sweeps.wait_for_two()
    assert fenced(server) == 0, "the fence of the exited writer stayed"
    assert leases_of(server)["reclaimed_writer_done"] == 1
