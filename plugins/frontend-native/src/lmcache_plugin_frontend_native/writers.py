"""Whether the process of a client holding fenced reservations has exited.

An expired STORE_RESERVE reservation stays fenced until its client commits or aborts the
key (``Session.fenced``): the client may be stalled mid-copy.  A client process that
exited copies nothing any more, so its fenced extents can go back too; one that never
comes back would otherwise keep them until the server stops.

Over ROUTER/DEALER the server does not see a peer's process, only the pid its HELLO
reports, which means nothing here if the client runs in another pid namespace (or is
another process here).  So a pid is watched only if, when first asked, it names a process
visible here that maps the arena segment itself (its device and inode in
``/proc/<pid>/maps``), through a pidfd, which a later reuse of the pid cannot fool.  A
client not seen so -- another pid namespace, a pid whose process does not map the arena,
a peer that held nothing while the pids kept here were trimmed past its HELLO -- keeps
its fenced extents until it commits or aborts them.  Left: a client in another pid namespace whose reported
pid happens to name another client here mapping the arena would be released when that
one exits.

Only the server's loop thread calls these methods.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from lmcache_tiers.plugin import pidfd_exited

#: HELLO pids kept (past it, the oldest of a peer holding nothing is dropped): a peer
#: picks its identity, so the table is bounded
MAX_PIDS = 4096


class WriterProcesses:
    """The pid each client reported, and pidfds of those watched for their exit."""

    def __init__(self, shm_device: int, shm_inode: int, holds: Callable[[bytes], bool]) -> None:
        """``holds(identity)``: whether that client holds anything (a session) now."""
        self._holds = holds
        # " <device> <inode> " as a maps line has them between the offset and the path
        self._place = f" {os.major(shm_device):02x}:{os.minor(shm_device):02x} {shm_inode} "
        self._pids: dict[bytes, int] = {}
        #: identity -> (pid, pidfd), or None when its process cannot be watched
        self._watched: dict[bytes, tuple[int, int] | None] = {}

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

    def exited(self, identity: bytes) -> bool:
        """Whether the process of the client ``identity`` is known to have exited; False
        when that cannot be told."""
        watched = self._watched_process(identity)
        return watched is not None and pidfd_exited(watched[1])

    def same_process(self, earlier: bytes, identity: bytes) -> bool:
        """Whether the client ``identity`` runs in the process, alive and watched, of the
        client ``earlier``: a client whose connection dropped and came back under a new
        identity (its HELLO reports the same pid, which a live process keeps)."""
        pid = self._pids.get(identity, 0)
        if pid <= 0 or (earlier not in self._watched and self._pids.get(earlier) != pid):
            return False  # not watched only to be told apart
        watched = self._watched_process(earlier)
        return watched is not None and watched[0] == pid and not pidfd_exited(watched[1])

    def _watched_process(self, identity: bytes) -> tuple[int, int] | None:
        if identity not in self._watched:
            pid = self._pids.get(identity, 0)
            pidfd = self._watch(pid)
            self._watched[identity] = None if pidfd is None else (pid, pidfd)
        return self._watched[identity]

    def _watch(self, pid: int) -> int | None:
        if pid <= 0:
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already, or never here: no proof it was our client's
            return None
        # Opened first: the maps read after it are those of the process the pidfd names.
        try:
            with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
                mapped = any(self._place in line for line in maps)
        except OSError:
            mapped = False
        if not mapped:
            os.close(pidfd)
            return None
        return pidfd

    def forget(self, identity: bytes) -> None:
        """The client holds nothing fenced any more: stop watching it."""
        watched = self._watched.pop(identity, None)
        if watched is not None:
            os.close(watched[1])

    def close(self) -> None:
        for watched in self._watched.values():
            if watched is not None:
                with contextlib.suppress(OSError):
                    os.close(watched[1])
        self._watched.clear()
