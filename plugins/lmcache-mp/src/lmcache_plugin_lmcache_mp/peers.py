"""The process of the client that prepared a store, whose exit lifts the store's fence.

LMCache's protocol carries no pid, so the process at the other end of a connection is
asked of the kernel (``lmcache_tiers.peer_process``: ``SO_PEERCRED`` over ``ipc://``,
the owner of the client's socket over loopback TCP), through the descriptor the
``prepare_store`` came in on (``zmq.SRCFD``), read while that message is handled.  Each
store keeps the watch of its own writer (``Transfer.writer``): a routing identity a client
picks itself may come back from another process, so the process is never taken from an
identity alone.

A lookup is made once per connection, told apart by the inode of the server's socket
(unique while the socket is open; a descriptor number is reused once it closes).  Left:
were the descriptor already another connection's when read (the client's connection
closed and the number went to a new connection between its message's arrival and this
read), the store would wait for that connection's process instead.  A client with an
automatic routing identity never gets that prepare's reply (its connection is gone, and
it comes back under a new identity), so never copies; one that chose its identity and
reconnected in that window does get it, and its fence could be lifted at the other
process's exit.

A connection whose process cannot be told (a remote client, one in a pid namespace not
visible here, a failed lookup) keeps the fences of its stores until their commit or its
unregister, as before.  Connections of one live process share its watch (one pidfd).

Only the server's loop thread calls these methods.
"""

from __future__ import annotations

import os
import weakref

from lmcache_tiers.plugin import PeerProcess, watch_peer

#: connections whose lookup is remembered (past it, the oldest is forgotten and looked up
#: again if it stores again); stores keep their own watch, so forgetting loses nothing
MAX_CONNECTIONS = 4096


class ConnectionProcesses:
    def __init__(self) -> None:
        #: identity -> (inode of the server's socket, its process's watch or None)
        self._of: dict[bytes, tuple[int, PeerProcess | None]] = {}
        #: the watch of each live process, shared by its connections and their stores;
        #: its pidfds are closed when the last of them lets it go
        self._by_pids: weakref.WeakValueDictionary[tuple[int, ...], PeerProcess] = (
            weakref.WeakValueDictionary()
        )

    def writer(self, identity: bytes, fd: int) -> PeerProcess | None:
        """The watch of the process at the other end of connection ``identity``, whose
        message came in on descriptor ``fd`` (None: it cannot be told)."""
        if fd < 0:
            return None
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            return None
        known = self._of.get(identity)
        if known is not None and known[0] == inode:
            return known[1]
        watch = watch_peer(fd)
        if watch is not None:
            shared = self._by_pids.get(watch.pids)
            if shared is not None and not shared.exited():
                watch.close()  # a pid names one process while it lives: this one
                watch = shared
            else:
                self._by_pids[watch.pids] = watch
        self._of.pop(identity, None)
        self._of[identity] = (inode, watch)
        if len(self._of) > MAX_CONNECTIONS:
            del self._of[next(iter(self._of))]
        return watch

    def close(self) -> None:
        """At the stop: forget every connection (stores still holding a watch close it
        when they go)."""
        self._of.clear()
