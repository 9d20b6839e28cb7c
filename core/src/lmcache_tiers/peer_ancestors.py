"""Whether an ancestor of a client's process holds the client's socket, read once per process.

A loopback TCP scan that finds the client's socket in the process its HELLO names (and
its descendants) still has that process's ancestors read (``peer_process._hinted_holders``):
one holding the socket too means the HELLO named a forked child while its parent may
write, and every process is scanned instead.  Reading an ancestor is reading all of its
descriptors, and the walk goes up to init, which may hold hundreds (310 on a 2-core test
machine, where reading the ancestors was about two thirds of a scan's 3-6 ms of CPU),
paid again for every connection of the process, whose first store competes with it for
the cores and the server's GIL.

What the ancestors held need not be read again for the same process.  An ancestor shares
a socket with its descendant only by having held it before that descendant was forked
(inheritance runs downwards), or by passing it over a Unix socket (``SCM_RIGHTS``), which
the client library never does (the scan already leaves that case out).  So once the
ancestors' sockets were read while a process was alive -- after it was forked -- every
socket that process can share with them by inheritance was in that reading (a socket the
process made itself, as its later connections' usually are, no ancestor can hold), and a
socket an ancestor closed since at worst has the full scan answer, as before.  A process
is known by its pid and start time (a pid reused is another process), and so is each
ancestor: an ancestor that exited since (the process reparented) is another one, read
then.  The chain itself is read again every time, one ``/proc/<pid>/stat`` each.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

__all__ = ["AncestorSockets"]

#: (pid, start time in clock ticks since boot): one process, never another with that pid
Identity = tuple[int, int]


def stat_of(pid: int) -> tuple[int, int] | None:
    """``pid``'s (parent pid, start time), or None if it cannot be read (exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # pid (comm) state ppid ... starttime (field 22): the name may hold spaces
            # and parentheses, so the fields are counted from after its last ")"
            fields = stat.read().rpartition(")")[2].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def sockets_held(pid: int) -> frozenset[int]:
    """The inodes of the sockets ``pid`` has descriptors of (none: exited, or not ours to
    look at -- as for any holder the scan cannot see)."""
    held: set[int] = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                held.add(int(target[8:-1]))
    except OSError:
        pass
    return frozenset(held)


class AncestorSockets:
    """The sockets each ancestor of a process held, read once while that process lived;
    the ``processes`` most recently asked about are remembered."""

    def __init__(self, processes: int = 256) -> None:
        self._processes = processes
        self._lock = threading.Lock()
        self._read: OrderedDict[Identity, dict[Identity, frozenset[int]]] = OrderedDict()

    def hold(self, pid: int, inode: int, own: int, limit: int) -> bool:
        """Whether a process above ``pid`` (its parent, theirs, up to the root) but ``own``
        holds the socket ``inode``; also when the chain cannot be read whole (a process of
        it exited meanwhile, more than ``limit`` of them), which the caller takes as a tree
        it cannot answer for."""
        stat = stat_of(pid)
        if stat is None:
            return True
        key = (pid, stat[1])
        with self._lock:
            read = self._read.pop(key, None) or {}
        parent = stat[0]
        try:
            for _ in range(limit):
                if parent <= 0:
                    return False  # above the root (init, or this namespace's first process)
                stat = stat_of(parent)
                if stat is None:
                    return True
                identity = (parent, stat[1])
                sockets = read.get(identity)
                if sockets is None:
                    sockets = frozenset() if parent == own else sockets_held(parent)
                    read[identity] = sockets
                if inode in sockets:
                    return True
                parent = stat[0]
            return True
        finally:
            with self._lock:
                self._read[key] = read
                while len(self._read) > self._processes:
                    self._read.popitem(last=False)
