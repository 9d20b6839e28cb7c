"""A connection-process scan held behind a gate, for the tests of a lookup off the loop
thread (``lmcache_tiers.peer_scan``): a test sees a lookup stay pending for as long as it
says, and which thread ran each one."""

from __future__ import annotations

import threading

from lmcache_tiers.peer_process import PeerProcess, PeerSocket, watch_peer_socket
from lmcache_tiers.peer_scan import PeerScanner

__all__ = ["GATE_S", "GatedScanner"]

#: how long a gated scan waits at most: a test that fails must not leave it for ever
GATE_S = 60.0


class GatedScanner:
    """``scan`` (the real one unless a front end's is given); the first ``gated`` lookups
    then wait for :attr:`gate` before their result is handed back (found while the client
    lived, armed when the test says).  :attr:`scanned` is set once the first has scanned."""

    def __init__(self, scan: PeerScanner = watch_peer_socket, gated: int = 1) -> None:
        self.scan = scan
        self.gated = gated
        self.gate = threading.Event()
        self.scanned = threading.Event()
        #: each lookup's far end and the name of the thread that ran it
        self.calls: list[tuple[PeerSocket, str]] = []

    def __call__(self, peer: PeerSocket) -> PeerProcess | None:
        self.calls.append((peer, threading.current_thread().name))
        watch = self.scan(peer)
        if len(self.calls) <= self.gated:
            self.scanned.set()
            self.gate.wait(GATE_S)
        return watch

    @property
    def threads(self) -> list[str]:
        """The names of the threads that ran the lookups, in order."""
        return [name for _, name in self.calls]
