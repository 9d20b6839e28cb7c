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
loopback TCP.  The pid a HELLO reports is only the fallback where the kernel cannot tell
(a remote peer, a client in the server's own process over TCP, a process the scan cannot
see, a connection through a relay process): it is the client's own word, in a pid
namespace the server may not share, and a pid naming another process would lift the
fence while the writer still copies.  Either way a process is watched only if it maps the
arena segment itself (its device and inode in ``/proc/<pid>/maps``), through a pidfd
opened before the maps are read, which a later reuse of the pid cannot fool: a relay's
process, which copies nothing, is never taken for the writer.  A client told neither way
keeps its fenced extents until it commits or aborts them.  Left: where the kernel cannot
tell, a client in another pid namespace whose reported pid happens to name another
client here mapping the arena would be released when that one exits.

Each session keeps the watches of the processes that reserved under its identity since it
last held nothing (``Session.writers``): a routing identity a client chose may come back
from another process, so its fences are lifted only once all of them have exited.

Only the server's loop thread calls these methods.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from lmcache_tiers.plugin import PeerProcess, watch_peer

#: HELLO pids kept (past it, the oldest of a peer holding nothing is dropped): a peer
#: picks its identity, so the table is bounded
MAX_PIDS = 4096

#: connections whose kernel lookup is remembered (past it, the oldest is forgotten and
#: looked up again at its next store): sessions keep their own watches
MAX_CONNECTIONS = 4096


class WriterProcesses:
    """Watches of the processes at the other end of clients' connections.

    A session's ``writers`` hold the kernel's watch of each process that reserved under its
    identity, or None where the kernel could not tell: the HELLO pid of that identity
    stands in for it, watched once asked (``_by_hello``, dropped by :meth:`forget`)."""

    def __init__(self, shm_device: int, shm_inode: int, holds: Callable[[bytes], bool]) -> None:
        """``holds(identity)``: whether that client holds anything (a session) now."""
        self._holds = holds
        # " <device> <inode> " as a maps line has them between the offset and the path
        self._place = f" {os.major(shm_device):02x}:{os.minor(shm_device):02x} {shm_inode} "
        self._pids: dict[bytes, int] = {}
        #: identity -> the watch of its HELLO pid (None: not a process mapping the arena)
        self._by_hello: dict[bytes, PeerProcess | None] = {}
        #: identity -> (inode of the server's socket, the kernel's watch of its process or None)
        self._by_kernel: dict[bytes, tuple[int, PeerProcess | None]] = {}

    def hello(self, identity: bytes, pid: int) -> None:
        pids = self._pids
        pids.pop(identity, None)
        pids[identity] = pid
        if len(pids) > MAX_PIDS:
            # Not the pid of a client holding reservations: a long-lived client's HELLO is
            # old, and without its pid its fences would outlive its process.
            holds = self._holds
            oldest = next((peer for peer in pids if not holds(peer)), next(iter(pids)))
            del pids[oldest]

    def of_request(self, identity: bytes, fd: int) -> PeerProcess | None:
        """The kernel's watch of the process of client ``identity`` whose request came in
        on ``fd`` (-1: not known); None when the kernel cannot tell (the HELLO pid stands
        in)."""
        if fd < 0:
            return None
        try:
            # The server socket's inode tells connections apart while it is open; a
            # descriptor's number is reused once it closes.
            inode = os.fstat(fd).st_ino
        except OSError:
            return None
        known = self._by_kernel.get(identity)
        if known is not None and known[0] == inode:
            return known[1]
        watch = self._mapping_the_arena(watch_peer(fd))
        if known is not None:
            del self._by_kernel[identity]
        self._by_kernel[identity] = (inode, watch)
        if len(self._by_kernel) > MAX_CONNECTIONS:
            del self._by_kernel[next(iter(self._by_kernel))]
        return watch

    def exited(self, identity: bytes, writers: Sequence[PeerProcess | None]) -> bool:
        """Whether every process that reserved under ``identity`` (its session's
        ``writers``) is known to have exited; False when that cannot be told."""
        if not writers:
            return False
        for writer in writers:
            watch = writer if writer is not None else self._hello_watch(identity)
            if watch is None or not watch.exited():
                return False
        return True

    def same_process(
        self,
        earlier: bytes,
        writers: Sequence[PeerProcess | None],
        identity: bytes,
        current: PeerProcess | None,
    ) -> bool:
        """Whether the processes that reserved under ``earlier`` (its ``writers``) are all
        the live process of the request of ``identity`` (``current``: the kernel's watch of
        it): a client whose connection dropped and came back under a new identity.  Each
        watch pins its process, so one alive names its pid still."""
        if current is None:
            if self._pids.get(identity, 0) <= 0 or self._pids.get(identity) != self._pids.get(earlier):
                return False  # not watched only to be told apart
            current = self._hello_watch(identity)
        if current is None or not writers or current.exited():
            return False
        for writer in writers:
            watch = writer if writer is not None else self._hello_watch(earlier)
            if watch is None or watch.pids != current.pids or watch.exited():
                return False
        return True

    def forget(self, identity: bytes) -> None:
        """The client holds no reservation any more: stop watching its HELLO pid."""
        watch = self._by_hello.pop(identity, None)
        if watch is not None:
            watch.close()

    def _hello_watch(self, identity: bytes) -> PeerProcess | None:
        if identity not in self._by_hello:
            pid = self._pids.get(identity, 0)
            self._by_hello[identity] = self._mapping_the_arena(_watch_pid(pid)) if pid > 0 else None
        return self._by_hello[identity]

    def _mapping_the_arena(self, watch: PeerProcess | None) -> PeerProcess | None:
        """``watch`` if one of its processes maps the arena (the pidfds are opened already:
        the maps read are those of the processes they name), else None, closed."""
        if watch is None:
            return None
        for pid in watch.pids:
            try:
                with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
                    if any(self._place in line for line in maps):
                        return watch
            except OSError:
                continue
        watch.close()
        return None

    def close(self) -> None:
        """At the stop: forget every connection and HELLO (sessions holding a kernel watch
        close it when they go)."""
        self._by_kernel.clear()
        for watch in self._by_hello.values():
            if watch is not None:
                watch.close()
        self._by_hello.clear()


def _watch_pid(pid: int) -> PeerProcess | None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already, or never here: no proof it was our client's
        return None
    return PeerProcess((pid,), [pidfd])


__all__ = ["MAX_CONNECTIONS", "MAX_PIDS", "WriterProcesses"]
