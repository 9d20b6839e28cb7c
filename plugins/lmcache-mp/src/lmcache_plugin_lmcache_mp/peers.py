"""The process of the client that prepared a store, whose exit lifts the store's fence.

LMCache's protocol carries no pid, so the process at the other end of a connection is
asked of the kernel (``lmcache_tiers.peer_process``: ``SO_PEERCRED`` over ``ipc://``,
the owner of the client's socket over loopback TCP), through the descriptor the
``prepare_store`` came in on (``zmq.SRCFD``), read while that message is handled.  Each
store keeps the watch of its own writer (``Transfer.writer``): a routing identity a client
picks itself may come back from another process, so the process is never taken from an
identity alone.

Over loopback TCP the owner is found by a scan of every process's descriptors (several
milliseconds on a host of a few hundred processes: ``bench/bench_peer_scan.py``), which
would hold up every client's requests if the loop thread ran it.  The loop only reads
the connection's addresses off the descriptor (:func:`peer_socket`, no scan); a worker
thread of its own scans and opens the pidfds, then arms the connection's
:class:`WriterWatch`.  Until then the watch is **pending**, and a pending watch never
says its process exited: the store's extents stay fenced (nothing is given back early),
and are given back at the first sweep after the scan found the process and it exited.
A loopback writer that exited before its scan ran is not found (its socket is gone): its
fences stay until its commit or unregister, as for any process that cannot be told (an
``ipc://`` one's pid was read at once: its pidfd finds it exited).

A lookup is made once per connection, told apart by the descriptor and the inode of the
server's socket (unique while the socket is open; a descriptor number is reused once it
closes): a client storing many times on one connection, or many connections of one
reconnecting client each storing, costs one scan per socket, pending or done.  Left:
were the descriptor already another connection's when read (the client's connection
closed and the number went to a new connection between its message's arrival and this
read), the store would wait for that connection's process instead.  A client with an
automatic routing identity never gets that prepare's reply (its connection is gone, and
it comes back under a new identity), so never copies; one that chose its identity and
reconnected in that window does get it, and its fence could be lifted at the other
process's exit.

A connection whose process cannot be told (a remote client, one in a pid namespace not
visible here, a failed lookup) keeps the fences of its stores until their commit or its
unregister, as before.  So does one whose scan failed (``mp_peer_scan_failed``: the scan
raised) or was given up (``mp_peer_scan_given_up``: more than :data:`MAX_PENDING_SCANS`
connections waiting for one, or the server stopping); the sweep takes both from
:meth:`ConnectionProcesses.take_failures` to count and log them.  A given-up connection is
looked up again at its next store.  Connections of one live process share its watch (one
pidfd).

:meth:`ConnectionProcesses.writer` and :meth:`ConnectionProcesses.close` are called by the
server's loop thread only; the worker touches only the watches it arms and its own maps.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from lmcache_tiers.plugin import BurstLog, PeerProcess, PeerSocket, peer_socket, watch_peer_socket

logger = logging.getLogger(__name__)

#: connections whose lookup is remembered (past it, the oldest is forgotten and looked up
#: again if it stores again); stores keep their own watch, so forgetting loses nothing
MAX_CONNECTIONS = 4096
#: connections waiting for their scan past which a new one is given up (counted): a
#: reconnect storm must not grow the worker's queue without bound
MAX_PENDING_SCANS = 1024

#: what finds and watches the process of a connection (a /proc scan over loopback TCP)
Scanner = Callable[[PeerSocket], PeerProcess | None]


class WriterWatch:
    """The watch of one connection's process, armed by the scan worker.

    Pending (not armed yet), unknown (armed with none) or closed, it never says exited:
    a store's fence waits for it as for a live writer."""

    def __init__(self) -> None:
        self._watch: PeerProcess | None = None
        self.armed = threading.Event()

    def arm(self, watch: PeerProcess | None) -> None:
        self._watch = watch
        self.armed.set()

    @property
    def process(self) -> PeerProcess | None:
        """The process watched (None while pending, or when it cannot be told)."""
        return self._watch

    def exited(self) -> bool:
        watch = self._watch  # one read: the worker may arm it meanwhile
        return watch is not None and watch.exited()


class ConnectionProcesses:
    def __init__(self, scan: Scanner = watch_peer_socket) -> None:
        self._scan = scan
        #: (descriptor, inode of the server's socket) -> its connection's watch (loop thread)
        self._of: OrderedDict[tuple[int, int], WriterWatch] = OrderedDict()
        self._queue: queue.Queue[tuple[PeerSocket, WriterWatch] | None] = queue.Queue(MAX_PENDING_SCANS)
        #: failures by reason, appended by both threads, counted by the sweep
        self._failures: deque[str] = deque()
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._scan_errors = BurstLog(logger)

    def writer(self, fd: int) -> WriterWatch | None:
        """The watch of the process at the other end of the connection whose message came
        in on descriptor ``fd`` (None: it cannot be told).  Never scans: a connection seen
        for the first time gets a pending watch, armed by the worker."""
        if fd < 0:
            return None
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return None
        known = self._of.get((fd, inode))
        if known is not None:
            self._of.move_to_end((fd, inode))
            return known
        peer = peer_socket(fd)
        if peer is None:
            return None  # not a socket whose far end the kernel names: nothing to scan
        watch = WriterWatch()
        if not self._submit(peer, watch):
            return watch  # given up (counted): pending for ever, looked up again next time
        self._of[(fd, inode)] = watch
        if len(self._of) > MAX_CONNECTIONS:
            self._of.popitem(last=False)
        return watch

    def _submit(self, peer: PeerSocket, watch: WriterWatch) -> bool:
        if self._stopping:
            return False
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="mp-peer-scan", daemon=True)
            self._worker.start()
        try:
            self._queue.put_nowait((peer, watch))
        except queue.Full:
            self._failures.append("mp_peer_scan_given_up")
            return False
        return True

    def _run(self) -> None:
        # The watch of each live process, shared by its connections and their stores; its
        # pidfds are closed when the last of them lets it go.  This thread's only.
        by_pids: weakref.WeakValueDictionary[tuple[int, ...], PeerProcess] = weakref.WeakValueDictionary()
        while (job := self._queue.get()) is not None:
            peer, watch = job
            if self._stopping:
                self._failures.append("mp_peer_scan_given_up")
                continue
            try:
                found = self._scan(peer)
            except Exception as exc:  # a scan must never end the worker: the connection stays unknown
                self._scan_errors.warn(
                    "mp_peer_scan_failed", "a client connection's process lookup raised: %s", exc
                )
                self._failures.append("mp_peer_scan_failed")
                found = None
            if found is not None:
                shared = by_pids.get(found.pids)
                if shared is not None and not shared.exited():
                    found.close()  # a pid names one process while it lives: this one
                    found = shared
                else:
                    by_pids[found.pids] = found
            watch.arm(found)

    def take_failures(self) -> Counter[str]:
        """Scans failed or given up since the last call, by reason (loop thread: the
        caller counts them)."""
        taken: Counter[str] = Counter()
        while self._failures:
            taken[self._failures.popleft()] += 1
        return taken

    def close(self) -> None:
        """At the stop: forget every connection and end the worker; scans not run yet are
        given up (stores still holding a watch close it when they go)."""
        self._stopping = True
        self._of.clear()
        while True:  # what waits is never scanned now
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._failures.append("mp_peer_scan_given_up")
        if self._worker is not None:
            self._queue.put_nowait(None)
            self._worker.join(timeout=1.0)  # one scan may be running: it is let finish
