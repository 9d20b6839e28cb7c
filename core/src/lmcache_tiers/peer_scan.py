"""The process of each client connection, looked up once per connection off the request loop.

A front end fencing a shared-memory writer's expired extents waits for that writer's
process (``peer_process``).  Over loopback TCP the process is found by a scan of every
process's descriptors (1.0-2.3 ms with 100 processes, 39-93 ms with 2,100 on a loaded
2-core host: ``bench/bench_peer_scan.py``), which would hold up every client's requests
if the loop thread ran it.  :class:`ConnectionPeers` is what both front ends use for it:

* the loop reads only what the kernel says of the descriptor at once
  (:func:`~lmcache_tiers.peer_process.peer_socket`: the ``SO_PEERCRED`` pid, or the TCP
  addresses) and gets a :class:`PeerWatch` at once, **pending**;
* a worker thread of its own scans and opens the pidfds, then arms the watch (from
  :data:`SCAN_DELAY_S` after the connection was first seen: the loop thread answers the
  request it came with first).  A pending
  watch never says its process exited, so a fence waiting for it stays (nothing is given
  back early); a loopback writer that exited before its scan ran is not found (its socket
  is gone), so the process its hint (the client's word: the native HELLO pid) names is
  pinned by a pidfd when the connection is first seen, and a scan that finds the client's
  socket held by no process arms the watch with that pinned process if it has exited or
  is exiting (:attr:`PeerWatch.pin`); otherwise such a watch is armed with none, as for
  any process that cannot be told;
* a connection is looked up once, pending or done, told apart by its descriptor and the
  inode of the server's socket (unique while the socket is open; a descriptor number is
  reused once it closes, and the closed connection is forgotten then);
* a scan that raised is counted (the front end's ``failed`` reason) and armed with none; a
  connection past ``max_pending`` waiting for its scan, or one still waiting at the stop,
  is given up (its ``given_up`` reason): pending for ever, so its fences stay, and looked
  up again at its next request.  :meth:`ConnectionPeers.count_failures` counts and logs them;
* connections of one live process share its watch (one pidfd per process), and so do
  their stand-ins (below): a client opening and closing connections while it lives holds
  one, not one per connection it ever had;
* a connection whose client is in a pid namespace this server cannot see
  (:attr:`~lmcache_tiers.peer_process.PeerSocket.foreign`) is armed with none at once, no
  scan, and counted (the front end's ``foreign`` reason) once per connection: nothing here
  names its process, so nothing but the client's own word (commit, abort, unregister) or
  the stop lifts its fences;
* a scan that found processes not mapping the arena
  (:func:`~lmcache_tiers.peer_process.watch_writer_socket`: a relay between the client and
  the server, which copies nothing) names no writer: the watch is armed with none
  (:attr:`PeerWatch.not_writer`) and counted (the front end's ``not_writer`` reason), so
  the relay's exit lifts no fence;
* where the scan names no writer and the front end's ``stand_in`` says the pinned process
  may be the client's (the native front end: it maps the arena), the pin is kept as
  :attr:`PeerWatch.stand_in`, asked on the worker as soon as it takes the connection
  (before the scan's delay and the scan), while that process most likely lives: a writer
  behind a relay that exits before anything needed its fences lifted, even before its
  connection's scan ran, is
  still known by the pidfd opened while it lived, not by its pid, which may name another
  process by then.

:meth:`ConnectionPeers.scan_now` runs a pending watch's scan on the caller's thread, for
the rare request that cannot be answered right without knowing its process.

Loop-thread methods: :meth:`~ConnectionPeers.watch`, :meth:`~ConnectionPeers.scan_now`,
:meth:`~ConnectionPeers.count_failures`, :meth:`~ConnectionPeers.close`; the worker
touches only the watches it arms and its own queue.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.peer_process import (
    PeerProcess,
    PeerSocket,
    peer_socket,
    process_exiting,
    socket_gone,
    watch_peer_socket,
)

__all__ = ["ConnectionPeers", "PeerScanner", "PeerWatch"]

logger = logging.getLogger(__name__)

#: what finds and watches the process of a connection (a /proc scan over loopback TCP);
#: None: it cannot be told
PeerScanner = Callable[[PeerSocket], PeerProcess | None]

#: seconds a connection's scan waits from when the loop thread first saw it: that thread
#: is still answering the request it came with, and a scan started at once takes the GIL
#: and a core from the reply (a fresh client's first STORE_RESERVE answered in 1.2-1.4 ms
#: instead of 0.5 on a 2-core machine).  Nothing needs the scan sooner: until it ends the
#: writer counts as alive, and a client gone meanwhile is found by its pin.
SCAN_DELAY_S = 0.005


class PeerWatch:
    """The watch of one connection's process, armed once by its scan.

    Pending (not armed yet), unknown (armed with none) or closed, it never says exited:
    a fence waits for it as for a live process."""

    def __init__(self, peer: PeerSocket) -> None:
        #: the connection's far end as read when it was first seen (what a scan looks for)
        self.peer = peer
        self._watch: PeerProcess | None = None
        #: the processes found at the far end do not map the arena: not the writer
        self.not_writer = False
        #: the process the client's hint named when the connection was first seen, pinned
        #: by a pidfd until the scan ends (see :meth:`ConnectionPeers._settle`)
        self.pin: PeerProcess | None = None
        #: that pinned process, kept where the scan named no writer and the front end's
        #: ``stand_in`` took it for the client's (set before the watch is armed); shared
        #: with the other connections of that process while it lives
        self.stand_in: PeerProcess | None = None
        #: ``stand_in`` took the pin for the client's while it lived, asked by the worker as
        #: soon as it took the connection (:meth:`ConnectionPeers._ask_pin`)
        self.pin_stands_in = False
        self.armed = threading.Event()
        #: when the loop thread first saw the connection (``time.monotonic()``)
        self.seen_at = time.monotonic()

    def arm(self, watch: PeerProcess | None, *, not_writer: bool = False) -> None:
        self._watch = watch
        self.not_writer = not_writer
        self.armed.set()

    @property
    def foreign(self) -> bool:
        """The client is in a pid namespace this server cannot see."""
        return self.peer.foreign

    @property
    def process(self) -> PeerProcess | None:
        """The process watched (None while pending, or when it cannot be told)."""
        return self._watch

    def exited(self) -> bool:
        watch = self._watch  # one read: the worker may arm it meanwhile
        return watch is not None and watch.exited()


class ConnectionPeers:
    """The :class:`PeerWatch` of each client connection, scanned for on a worker thread."""

    def __init__(
        self,
        scan: PeerScanner = watch_peer_socket,
        *,
        failed: str = "peer_scan_failed",
        given_up: str = "peer_scan_given_up",
        foreign: str = "peer_foreign_namespace",
        not_writer: str = "peer_not_writer",
        max_pending: int = 1024,
        max_connections: int = 4096,
        thread_name: str = "tiers-peer-scan",
        stand_in: Callable[[PeerProcess], bool] | None = None,
    ) -> None:
        """``failed`` / ``given_up`` / ``foreign`` / ``not_writer``: the reasons a front end
        counts them under (see the module);
        ``stand_in(pinned)``: whether the live process a connection's hint named may stand
        in for the writer where its scan names none (kept as :attr:`PeerWatch.stand_in`
        if that process still lives once asked); None: never;
        ``max_pending``: connections waiting for their scan past which a new one is given
        up (a reconnect storm must not grow the queue without bound); ``max_connections``:
        connections remembered (past it the oldest is forgotten, and looked up again if it
        comes back: whoever holds its watch keeps it)."""
        self._scan = scan
        self._stand_in = stand_in
        self.failed, self.given_up = failed, given_up
        self.foreign, self.not_writer = foreign, not_writer
        self._max_connections = max_connections
        self._thread_name = thread_name
        #: descriptor -> (inode of the server's socket, its connection's watch), loop thread.
        #: By descriptor: a connection that closed is forgotten as soon as its number goes to
        #: another, so the watches (and pidfds) of closed connections are not kept.
        self._of: OrderedDict[int, tuple[int, PeerWatch]] = OrderedDict()
        self._queue: queue.Queue[PeerWatch | None] = queue.Queue(max_pending)
        #: failures by reason, appended by both threads, counted by :meth:`count_failures`
        self._failures: deque[str] = deque()
        self._worker: threading.Thread | None = None
        self._stopping = False
        # The watch of each live process, shared by its connections; its pidfds are closed
        # when the last holder lets it go.  Arming happens under the lock: the loop's
        # scan_now and the worker may settle the same watch.
        self._by_pids: weakref.WeakValueDictionary[tuple[int, ...], PeerProcess]
        self._by_pids = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._scan_errors = BurstLog(logger)
        self._failure_log = BurstLog(logger)
        self._gone = BurstLog(logger, level=logging.INFO)

    def watch(self, fd: int, hint: int = 0) -> PeerWatch | None:
        """The watch of the process at the other end of the connection whose message came
        in on descriptor ``fd``, read while that message is handled (None: it cannot be
        told).  Never scans: a connection seen for the first time gets a pending watch.
        ``hint``: the pid the client said it has (0: none), where the scan of a connection
        seen for the first time looks first (:attr:`PeerSocket.hint`: never trusted)."""
        if fd < 0:
            return None
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return None
        known = self._of.get(fd)
        if known is not None:
            if known[0] == inode:
                self._of.move_to_end(fd)
                return known[1]
            del self._of[fd]  # that connection closed: its number is this one's now
        peer = peer_socket(fd)
        if peer is None:
            return None  # not a socket whose far end the kernel names: nothing to scan
        if hint > 0 and peer.far:
            peer = dataclasses.replace(peer, hint=hint)
        watch = PeerWatch(peer)
        if peer.foreign:
            # Nothing to scan for: no pid here names it.  Remembered, so counted (and
            # logged) once per connection.
            watch.arm(None)
            self._failures.append(self.foreign)
        else:
            # The raw hint, not only a scan's (loopback TCP): over ``ipc://`` a relay's pid
            # is what SO_PEERCRED names, and the client's may have to stand in for it.
            watch.pin = _pin(hint)
            if not self._submit(watch):
                _unpin(watch)
                return watch  # given up (counted): pending for ever, looked up again next time
        self._of[fd] = (inode, watch)
        if len(self._of) > self._max_connections:
            self._of.popitem(last=False)
        return watch

    def scan_now(self, watch: PeerWatch) -> None:
        """Settle a pending ``watch`` here and now (a scan on the caller's thread), unless
        the stop has begun; the worker skips it once armed."""
        if not watch.armed.is_set() and not self._stopping:
            self._settle(watch)

    def _submit(self, watch: PeerWatch) -> bool:
        if self._stopping:
            return False
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self._worker.start()
        try:
            self._queue.put_nowait(watch)
        except queue.Full:
            self._failures.append(self.given_up)
            return False
        return True

    def _run(self) -> None:
        while (watch := self._queue.get()) is not None:
            self._ask_pin(watch)
            wait = watch.seen_at + SCAN_DELAY_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # see SCAN_DELAY_S; a connection queued longer waits no more
            if watch.armed.is_set():
                continue  # settled meanwhile on the caller's thread (scan_now): nothing to do
            if self._stopping:
                self._failures.append(self.given_up)
            else:
                self._settle(watch)

    def _settle(self, watch: PeerWatch) -> None:
        failure = None
        try:
            found = self._scan(watch.peer)
        except Exception as exc:  # a scan must never end the worker: the connection stays unknown
            self._scan_errors.warn(self.failed, "a client connection's process lookup raised: %s", exc)
            failure, found = self.failed, None
        not_writer = False
        if found is not None and not found.writer:
            found.close()  # a relay, or a process that never mapped the arena: never waited for
            failure, found, not_writer = self.not_writer, None, True
        pinned = watch.pin if found is None and _gone_with_its_pin(watch) else None
        stands_in = found is None and pinned is None and self._pinned_stands_in(watch)
        with self._lock:
            if watch.armed.is_set():  # settled meanwhile by the other thread, which counted it
                if found is not None:
                    found.close()
                return
            if failure is not None:
                self._failures.append(failure)  # once per connection: by the thread arming it
            if pinned is not None:
                # Not shared by pid: the pin is of a process that has exited, or is exiting,
                # whose pid may already name another process.
                watch.pin = None
                self._gone.warn(
                    "gone",
                    "a client connection was closed before its process lookup ran, the process "
                    "its HELLO named exiting or gone (pid %d): that process is taken as its "
                    "writer, whose exit lifts its fences",
                    pinned.pids[0],
                )
                watch.arm(pinned, not_writer=not_writer)
                return
            if stands_in and watch.pin is not None:
                pin, watch.pin = watch.pin, None
                # One gone since it was asked is not shared by pid: its pid may name
                # another process now.  Its pidfd still says it exited.
                watch.stand_in = self._shared(pin) if pin.all_alive() else pin
            _unpin(watch)
            watch.arm(self._shared(found), not_writer=not_writer)

    def _shared(self, process: PeerProcess | None) -> PeerProcess | None:
        """The watch kept of ``process``'s live processes, shared by every connection of
        theirs (one pidfd per process, not per connection: a client's connections come and
        go while it lives), ``process`` closed if one is kept already; under the lock."""
        if process is None:
            return None
        shared = self._by_pids.get(process.pids)
        # Both alive at the moment the kept one is asked (``process`` was opened before
        # and lives after it): a pid names one process while it lives, so they are one.
        # Not one of which a process exited: its pid may name another now.
        if shared is not None and shared.all_alive() and process.all_alive():
            process.close()
            return shared
        self._by_pids[process.pids] = process
        return process

    def _ask_pin(self, watch: PeerWatch) -> None:
        """Ask ``stand_in`` of a connection's pin as soon as the worker takes it, before
        :data:`SCAN_DELAY_S` and the scan (tens of milliseconds with many processes): a
        writer behind a relay that exits meanwhile leaves no maps to read, so asked only
        after the scan it could not stand in, and its fences -- the relay holding the
        connection on -- stayed until the server stopped.  Not asked where the kernel
        names the hinted process itself (``SO_PEERCRED``): the scan finds it there."""
        pin, peer = watch.pin, watch.peer  # one read of the pin: scan_now may unpin it
        if pin is None or watch.armed.is_set() or pin.pids == (peer.pid,):
            return
        if self._pinned_stands_in(watch):
            watch.pin_stands_in = True

    def _pinned_stands_in(self, watch: PeerWatch) -> bool:
        """Whether ``watch``'s pin may stand in for its writer (``stand_in``), asked while
        the pinned process lives: one alive once asked was the one asked of (its pid had
        not gone to another process), and one gone before leaves nothing to ask."""
        if watch.pin_stands_in:
            return True  # asked when the worker took the connection (``_ask_pin``)
        pin = watch.pin  # one read: the other thread settling it may unpin it meanwhile
        stand_in = self._stand_in
        if pin is None or stand_in is None or watch.peer.remote:
            return False  # a remote client's pid names no process here
        return stand_in(pin) and pin.all_alive()

    def take_failures(self) -> Counter[str]:
        """Scans failed or given up since the last call, by reason."""
        taken: Counter[str] = Counter()
        while self._failures:
            taken[self._failures.popleft()] += 1
        return taken

    def count_failures(self, count: Callable[[str, int], None], meaning: Callable[[str], str]) -> None:
        """Count (``count(reason, n)``) and log the lookups failed, given up, of a foreign
        namespace or finding no writer since the last call; ``meaning(reason)`` says what
        that does to their connections' fences."""
        found = {
            self.failed: "failed",
            self.given_up: "were given up",
            self.foreign: "found a client in a pid namespace this server cannot see",
            self.not_writer: (
                "found only processes not mapping the arena (a relay?) or whose maps may "
                "not be read (another user's), not the writer"
            ),
        }
        for reason, n in self.take_failures().items():
            count(reason, n)
            self._failure_log.warn(
                reason,
                "%d client connections' process lookups %s; %s [%s]",
                n,
                found.get(reason, reason),
                meaning(reason),
                reason,
                count=n,
            )

    def close(self) -> None:
        """At the stop: forget every connection and end the worker; scans not run yet are
        given up (whoever holds a watch closes it when letting it go)."""
        self._stopping = True
        self._of.clear()
        while True:  # what waits is never scanned now
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and not job.armed.is_set():  # one scan_now settled is not given up
                self._failures.append(self.given_up)
        if self._worker is not None:
            self._queue.put_nowait(None)
            self._worker.join(timeout=1.0)  # one scan may be running: it is let finish


def _pin(hint: int) -> PeerProcess | None:
    """A pidfd on the process the client says it is, opened while its connection's first
    request is handled (the pid may name another process once that one exits)."""
    if hint <= 0 or hint == os.getpid():
        return None
    try:
        return PeerProcess((hint,), [os.pidfd_open(hint)])
    except OSError:  # no such process, or no pidfds here: nothing pinned
        return None


def _unpin(watch: PeerWatch) -> None:
    pin, watch.pin = watch.pin, None
    if pin is not None:
        pin.close()


def _gone_with_its_pin(watch: PeerWatch) -> bool:
    """Whether a connection whose scan named no writer is known gone with the process its
    hint pinned: the client's socket is held by no process (every holder closed it, or
    exited; or it was reset), and the pinned process has exited or is exiting (marked so
    before it closes its descriptors).  A client that closed its connection, or had it
    reset, and lives on (a dropped connection it comes back from) leaves its pin alive and
    not exiting, so the HELLO pid stands in for it as before; one whose hint names another
    process keeps its fences as before unless that process ends within the same moments."""
    pin = watch.pin
    if pin is None or not socket_gone(watch.peer):
        return False
    return pin.exited() or process_exiting(pin.pids[0])
