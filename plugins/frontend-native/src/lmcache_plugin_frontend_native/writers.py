"""The processes of the clients holding fenced reservations, and whether they have exited.

An expired STORE_RESERVE reservation stays fenced until its client commits or aborts the
key (``Session.fenced``): the client may be stalled mid-copy.  A client process that
exited copies nothing any more, so its fenced extents can go back too; one that never
comes back would otherwise keep them until the server stops.

The process is asked of the kernel first, as the LMCache front end does
(``lmcache_tiers.plugin.watch_peer``): the process at the other end of the connection the
STORE_RESERVE came in on (``zmq.SRCFD``, read while the request is handled), through
``SO_PEERCRED`` over ``ipc://`` -- translated into the server's pid namespace, so a client
in a container's namespace is seen too -- or the owner of the client's socket over
loopback TCP, whose scan looks first in the HELLO pid's process and its descendants (a
hint only: what is found there holds the socket, and a pid holding none of it has every
process scanned; core's ``peer_process``).  The pid a HELLO reports is only the fallback
where the kernel names no writer for a local client (a client in the server's own process
over TCP, a process the scan cannot see, a connection through a relay process, a failed
scan): it is the client's
own word, in a pid namespace the server may not share, and a pid naming another process
would lift the fence while the writer still copies.  It is the pid the identity's HELLO
reported when the reservation was made, kept with the session's writers
(:meth:`WriterProcesses.note`): a routing identity a client chose may be taken over by
another process once its connection drops, and that one's HELLO, read later, would have
its exit lift the fences of the writer it took over from, or its commit over a
connection of its own give them back (:meth:`WriterProcesses.same_process`), while that
writer lives and may still copy.  Either way a process is watched only
if it maps the arena segment itself (core's ``watch_writer_socket`` and ``maps_file``:
its device and inode in ``/proc/<pid>/maps``), through a pidfd opened before the maps are
read, which a later reuse of the pid cannot fool: a relay's process, which copies
nothing, is never taken for the writer (``peer_not_writer`` counts those connections).

The HELLO pid's process is pinned by a pidfd when the connection's first request comes
in, and the scan worker reads its maps as soon as it takes the connection, before the
lookup, kept where the kernel names no writer (core's ``PeerWatch.stand_in``): a writer
behind a relay that dies holding its reservation, before any sweep needed its fences --
even before its connection's lookup ran --, is seen to exit through that pidfd (its pid,
asked at the sweep, named nothing any more, and the fence stayed until the server
stopped).  Where that pin is not the one pid the reservations were made under
(a HELLO pid changed between them, a connection the kernel names nothing of, a process
gone before its maps were read), the HELLO pids are watched when first asked: one gone by
then proves nothing, and its fences wait for the client's commit or abort.

The HELLO pid is never asked where it cannot be the writer's in this namespace, and the
client's fences then stay until it commits or aborts them, or the server stops:

* ``SO_PEERCRED`` named pid 0: the client is in a pid namespace the server cannot see, so
  its HELLO pid is of that namespace and may name any process here (counted once per
  connection, ``peer_foreign_namespace``, and logged);
* a TCP peer off this host (neither on loopback nor at the server's own address: core's
  ``PeerSocket.remote``): another host's process cannot map the arena, so it copies
  into no extent of it, and one on this host behind another network namespace (a
  container's) is most likely in another pid namespace too.

A client told neither way keeps its fenced extents until it commits or aborts them.
Left: where the HELLO pid stands in, a client in another pid namespace reaching the
server through a relay, whose reported pid happens to name another client here mapping
the arena, would be released when that one exits, and counts until then as watched
(:meth:`WriterProcesses.unwatched`), outside the bound of unwatched clients' fences.

The kernel is asked through core's ``ConnectionPeers`` (``lmcache_tiers.peer_scan``, as the
LMCache front end), once per connection (descriptor and socket inode), off the loop thread:
over loopback TCP the owner is found in the HELLO process's tree first, else by a scan of
every process's descriptors (1.0-2.3 ms with 100 processes, 39-93 ms with 2,100, at a load
of 4-5 on 2 cores), and the arena check reads the process's maps, which
held every other client's requests up at each connection's first STORE_RESERVE.  The loop
reads only the connection's far end; a worker thread scans, checks the maps and arms the
connection's ``PeerWatch``.  Until then the watch is pending and counts as a live writer:
the fences stay (the HELLO pid is not asked meanwhile).  A client gone before its lookup
ran is watched as the process its HELLO pid named when the connection's first request
came in (pinned then by a pidfd), where the scan finds the client's socket held by no
process and that process exited or is exiting (core's ``peer_scan``).  A scan that raised
(``peer_scan_failed``) is counted and logged, and the HELLO pid stands in as where the
kernel cannot tell; one given up (``peer_scan_given_up``: over 1,024 connections waiting
for theirs, or the server stopping) stays pending, so its fences wait for the client's
commit or abort; the connection is looked up again at its next STORE_RESERVE.  Only a
commit or abort of keys its client holds no reservation of, while another client holds
reservations (a client back after a drop, :meth:`WriterProcesses.same_process`), settles a
pending lookup on the loop thread: it cannot be answered right without the process, and
each connection is scanned once.

Each session keeps the watches of the processes that reserved under its identity since it
last held nothing (``Session.writers``): a routing identity a client chose may come back
from another process, so its fences are lifted only once all of them have exited.

Only the server's loop thread calls these methods (the scan worker runs :attr:`scan`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial

from lmcache_tiers.plugin import (
    ConnectionPeers,
    PeerProcess,
    PeerScanner,
    PeerWatch,
    maps_file,
    watch_writer_socket,
)

#: HELLO pids kept (past it, the oldest of a peer holding nothing is dropped): a peer
#: picks its identity, so the table is bounded
MAX_PIDS = 4096

#: HELLO pids one identity's fences wait for (past it, none: its fences stay until its
#: commit or abort): a peer may greet under any pid between its reservations, and each is
#: a pidfd held
MAX_PIDS_RESERVED_AS = 16


class WriterProcesses:
    """Watches of the processes at the other end of clients' connections.

    A session's ``writers`` hold the kernel's watch of each connection that reserved under
    its identity (a ``PeerWatch``), or None where the kernel could not tell at all; where
    the watch names no process (armed with none) or there is none, the HELLO pids that
    identity had when it reserved stand in (``_reserved_as``), watched once asked
    (``_by_hello``); both dropped by :meth:`forget`."""

    def __init__(self, shm_device: int, shm_inode: int, holds: Callable[[bytes], bool]) -> None:
        """``holds(identity)``: whether that client holds anything (a session) now."""
        self._holds = holds
        self._arena = (shm_device, shm_inode)
        self._pids: dict[bytes, int] = {}
        #: identity -> the HELLO pids it had as it made the reservations it holds (0: it
        #: had none); one entry per identity holding reservations, dropped by forget()
        self._reserved_as: dict[bytes, tuple[int, ...]] = {}
        #: identity -> the watch of its ``_reserved_as`` pids (None: not a process mapping
        #: the arena, or not all of them watched)
        self._by_hello: dict[bytes, PeerProcess | None] = {}
        #: what finds a connection's writer (its processes, if one maps the arena), run on
        #: the scan worker
        self.scan: PeerScanner = partial(watch_writer_socket, arena=self._arena)
        self.connections = ConnectionPeers(
            lambda peer: self.scan(peer),
            failed="peer_scan_failed",
            given_up="peer_scan_given_up",
            foreign="peer_foreign_namespace",
            not_writer="peer_not_writer",
            thread_name="tiers-native-peer-scan",
            stand_in=self._maps_the_arena,
        )

    def _maps_the_arena(self, process: PeerProcess) -> bool:
        """Whether ``process`` maps the arena (asked on the scan worker)."""
        return maps_file(process.pids, *self._arena)

    def hello(self, identity: bytes, pid: int) -> None:
        pids = self._pids
        pids.pop(identity, None)
        pids[identity] = pid
        if len(pids) > MAX_PIDS:
            # Not the pid of a client holding reservations: a long-lived client's HELLO is
            # old, and without its pid the fences of its next reservations would outlive
            # its process (those made already are watched as ``_reserved_as`` says).
            holds = self._holds
            oldest = next((peer for peer in pids if not holds(peer)), next(iter(pids)))
            del pids[oldest]

    def of_request(self, fd: int, identity: bytes) -> PeerWatch | None:
        """The kernel's watch of the process whose request came in on ``fd`` (-1: not
        known), pending until its scan ends; None when the kernel cannot tell at all.
        ``identity``'s HELLO pid is where a loopback TCP scan looks first: the socket found
        in that process or its descendants names them, without reading every process's
        descriptors; not found there, every process is scanned (core's ``peer_process``)."""
        return self.connections.watch(fd, hint=self._pids.get(identity, 0))

    def note(self, identity: bytes, writers: list[PeerWatch | None], watch: PeerWatch | None) -> None:
        """Add ``watch`` to the ``writers`` of ``identity``'s session as it reserves: one
        per live process, so a client reserving over many connections (or over one, again
        and again) adds none once its lookups have ended; a watch armed since it was added
        may now name one kept.  The identity's HELLO pid now is kept too: where the kernel
        names no writer, the process it names is the one whose exit lifts these fences,
        whatever pid a later HELLO under the identity reports."""
        pid = self._pids.get(identity, 0)
        # None reserved before (or what did is done with: its exit lifts nothing now)
        reserved_as = self._reserved_as.get(identity, ()) if writers else ()
        if pid not in reserved_as and 0 not in reserved_as:  # 0: watched as none already
            if len(reserved_as) >= MAX_PIDS_RESERVED_AS:
                pid = 0
            # Watched anew, as every pid its reservations were made under.
            self._reserved_as[identity] = (*reserved_as, pid)
            self._close_hello_watch(identity)
            if reserved_as:
                # Rare (a client greeting as another pid between its reservations): all
                # watched now, while the pid just told names its process; one of them gone
                # already, no pidfd proves it was the writer, and none is watched.
                self._hello_watch(identity)
        if watch not in writers:
            writers.append(watch)
        kept: list[PeerWatch | None] = []
        for writer in writers:
            if not any(_same_live_process(earlier, writer) for earlier in kept):
                kept.append(writer)
        writers[:] = kept

    def exited(self, identity: bytes, writers: Sequence[PeerWatch | None]) -> bool:
        """Whether every process that reserved under ``identity`` (its session's
        ``writers``) is known to have exited; False when that cannot be told, and while a
        lookup is pending."""
        if not writers:
            return False
        for writer in writers:
            if writer is not None and not writer.armed.is_set():
                return False  # its process not known yet: taken as alive
            watch = self._process_of(identity, writer)
            if watch is None or not watch.exited():
                return False
        return True

    def unwatched(
        self,
        identity: bytes,
        writers: Sequence[PeerWatch | None],
        *,
        holds: bool = True,
    ) -> bool:
        """Whether the exit of the processes that reserved under ``identity`` (``writers``)
        can never be seen, so that its fences lift only at its commit or abort: one of
        its lookups names no process, nor a HELLO pid standing in that maps the arena
        (another pid namespace or host, a relay, a failed scan), or is still pending.  A
        pending lookup never says its process exited (:meth:`exited`), and one given up
        (a reconnect storm past the scan queue) stays pending for ever: counted as watched,
        a stream of such clients would pin L1 past the bound.  A HELLO pid asked is
        watched from then on only if ``holds`` (the client holds reservations, so
        :meth:`forget` closes the watch when it holds none)."""
        if not writers:
            return True  # nothing to watch: an exit lifts nothing
        if any(writer is not None and not writer.armed.is_set() for writer in writers):
            return True
        return not all(self._watchable(identity, writer, holds) for writer in writers)

    def _watchable(self, identity: bytes, writer: PeerWatch | None, holds: bool) -> bool:
        """Whether a settled ``writer``'s exit can be seen: it names a process, or the HELLO
        pid of ``identity`` stands in and maps the arena."""
        if writer is not None and writer.process is not None:
            return True
        if not _hello_may_stand_in(writer):
            return False
        if holds:
            pinned = _pinned_as(writer, self._reserved_as.get(identity, ()))
            return pinned is not None or self._hello_watch(identity) is not None
        # Nothing held: what a reservation made now would be watched as.
        pid = self._pids.get(identity, 0)
        if _pinned_as(writer, (pid,)) is not None:
            return True
        watch = self._mapping_the_arena(_watch_pids((pid,)))
        if watch is None:
            return False
        watch.close()
        return True

    def same_process(
        self,
        earlier: bytes,
        writers: Sequence[PeerWatch | None],
        identity: bytes,
        current: PeerWatch | None,
    ) -> bool:
        """Whether the processes that reserved under ``earlier`` (its ``writers``) are all
        the live process of the request of ``identity`` (``current``: the kernel's watch of
        it): a client whose connection dropped and came back under a new identity.  Each
        watch pins its process, so one alive names its pid still.  A pending lookup is
        settled here (once per connection); one that cannot be (the stop) tells nothing."""
        if not writers or not self._settled(current):
            return False
        process = current.process if current is not None else None
        told = None
        if process is None and not _hello_may_stand_in(current):
            return False  # nothing here names it: not tied to another identity
        if process is None:
            pid = self._pids.get(identity, 0)
            if pid <= 0 or self._reserved_as.get(earlier) != (pid,):
                return False  # not watched only to be told apart
            process = _pinned_as(current, (pid,))
            if process is None:
                # Watched only for this answer, not kept as ``identity``'s: a client asking
                # may hold nothing, so no forget() would ever close it.
                process = told = self._mapping_the_arena(_watch_pids((pid,)))
        try:
            return process is not None and not process.exited() and self._all_of(earlier, writers, process)
        finally:
            if told is not None:
                told.close()

    def _all_of(self, earlier: bytes, writers: Sequence[PeerWatch | None], process: PeerProcess) -> bool:
        """Whether each of ``earlier``'s ``writers`` is the live ``process``."""
        for writer in writers:
            if not self._settled(writer):
                return False
            watch = self._process_of(earlier, writer)
            if watch is None or watch.pids != process.pids or not watch.all_alive():
                return False  # one exited: its pid may name another process, ``process``'s
        return True

    def _settled(self, watch: PeerWatch | None) -> bool:
        if watch is not None:
            self.connections.scan_now(watch)
            return watch.armed.is_set()
        return True

    def _process_of(self, identity: bytes, writer: PeerWatch | None) -> PeerProcess | None:
        """The process a settled ``writer`` names, else the HELLO pid's of ``identity``
        where that may be the writer's."""
        process = writer.process if writer is not None else None
        if process is not None or not _hello_may_stand_in(writer):
            return process
        pinned = _pinned_as(writer, self._reserved_as.get(identity, ()))
        return pinned if pinned is not None else self._hello_watch(identity)

    def forget(self, identity: bytes) -> None:
        """The client holds no reservation any more: stop watching its HELLO pid."""
        self._reserved_as.pop(identity, None)
        self._close_hello_watch(identity)

    def _close_hello_watch(self, identity: bytes) -> None:
        watch = self._by_hello.pop(identity, None)
        if watch is not None:
            watch.close()

    def count_failures(self, count: Callable[[str, int], None]) -> None:
        """Count and log the connections whose lookup failed or was given up."""
        self.connections.count_failures(count, _meaning)

    def _hello_watch(self, identity: bytes) -> PeerProcess | None:
        """The watch of the HELLO pids ``identity`` reserved under (exited once all have)."""
        if identity not in self._by_hello:
            pids = self._reserved_as.get(identity, ())
            self._by_hello[identity] = self._mapping_the_arena(_watch_pids(pids))
        return self._by_hello[identity]

    def _mapping_the_arena(self, watch: PeerProcess | None) -> PeerProcess | None:
        """``watch`` if one of its processes maps the arena (the pidfds are opened already:
        the maps read are those of the processes they name), else None, closed."""
        if watch is None:
            return None
        if maps_file(watch.pids, *self._arena):
            return watch
        watch.close()
        return None

    def close(self) -> None:
        """At the stop: forget every connection (lookups not run yet are given up) and
        HELLO (sessions holding a kernel watch close it when they go)."""
        self.connections.close()
        self._reserved_as.clear()
        for watch in self._by_hello.values():
            if watch is not None:
                watch.close()
        self._by_hello.clear()


def _same_live_process(one: PeerWatch | None, other: PeerWatch | None) -> bool:
    if one is None or other is None:
        return one is other
    if one is other:
        return True
    mine, theirs = one.process, other.process
    # Every process of ``mine`` alive: its pids name them still (a pid of one that exited
    # may name another process now, one ``theirs`` holds and ``mine`` does not watch)
    return mine is not None and theirs is not None and mine.pids == theirs.pids and mine.all_alive()


def _pinned_as(watch: PeerWatch | None, pids: tuple[int, ...]) -> PeerProcess | None:
    """The process pinned for ``watch``'s connection when its first request came in (the
    HELLO pid's, found mapping the arena while it lived: core's ``PeerWatch.stand_in``),
    where ``pids`` are just its pid: the pid the identity reserved under names that very
    process, so its exit counts even if it came before anything asked for it."""
    pinned = watch.stand_in if watch is not None else None
    return pinned if pinned is not None and pinned.pids == pids else None


def _hello_may_stand_in(watch: PeerWatch | None) -> bool:
    """Whether a client's HELLO pid may name its process in this namespace: not where the
    kernel said the client is in a pid namespace not visible here, nor for a peer on
    another host or network namespace (see the module)."""
    return watch is None or not (watch.foreign or watch.peer.remote)


def _meaning(reason: str) -> str:
    if reason == "peer_foreign_namespace":
        return "their HELLO pids are not watched: their fences stay until their clients commit or abort"
    if reason in ("peer_scan_failed", "peer_not_writer"):
        return "the pid their clients' HELLO reported stands in for the writer, where it maps the arena"
    return "their fences stay until their clients commit or abort (looked up again at the next STORE_RESERVE)"


def _watch_pids(pids: tuple[int, ...]) -> PeerProcess | None:
    """A watch of every one of ``pids``, or None if one cannot be watched (no pid told)."""
    pidfds: list[int] = []
    try:
        for pid in pids:
            if pid <= 0:
                raise ProcessLookupError(pid)
            pidfds.append(os.pidfd_open(pid))
    except OSError:  # gone already, or never here: no proof it was our client's
        for pidfd in pidfds:
            os.close(pidfd)
        return None
    return PeerProcess(pids, pidfds) if pidfds else None


__all__ = ["MAX_PIDS", "WriterProcesses"]
