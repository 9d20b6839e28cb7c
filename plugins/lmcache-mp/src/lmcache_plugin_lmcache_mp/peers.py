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
would hold up every client's requests if the loop thread ran it.  Core's
``ConnectionPeers`` (``lmcache_tiers.peer_scan``, as the native front end) runs it: the
loop only reads the connection's addresses off the descriptor (no scan); a worker thread
of its own scans and opens the pidfds, then arms the connection's :class:`WriterWatch`
(a ``PeerWatch``).  Until then the watch is **pending**, and a pending watch never
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

A process found at a connection's far end is the writer only if it maps the shared-memory
segment itself (core's ``watch_writer_socket`` checks its maps right after its scan): a
client reaching the server through a local relay (a ZeroMQ proxy) has the relay at the
far end, which copies nothing, and whose exit used to lift the fences while the client
could still copy.  Such a connection is counted (``mp_peer_not_writer``) and keeps its
stores' fences until their commit or its unregister.  So does a client in a pid namespace
this server cannot see (``SO_PEERCRED`` names pid 0: ``mp_peer_foreign_namespace``,
counted once per connection).

A connection whose process cannot be told (a remote client, a failed lookup) keeps the
fences of its stores until their commit or its unregister, as before.  So does one whose
scan failed (``mp_peer_scan_failed``: the scan raised) or was given up
(``mp_peer_scan_given_up``: more than :data:`MAX_PENDING_SCANS` connections waiting for
one, or the server stopping); the sweep takes these four from
:meth:`ConnectionProcesses.count_failures` to count and log them.  A given-up connection is
looked up again at its next store.  Connections of one live process share its watch (one
pidfd).

:meth:`ConnectionProcesses.writer` and :meth:`ConnectionProcesses.close` are called by the
server's loop thread only; the worker touches only the watches it arms and its own queue.
"""

from __future__ import annotations

from functools import partial

from lmcache_tiers.plugin import (
    ConnectionPeers,
    PeerScanner,
    PeerWatch,
    watch_peer_socket,
    watch_writer_socket,
)

__all__ = ["MAX_CONNECTIONS", "MAX_PENDING_SCANS", "ConnectionProcesses", "Scanner", "WriterWatch"]

#: connections whose lookup is remembered (past it, the oldest is forgotten and looked up
#: again if it stores again); stores keep their own watch, so forgetting loses nothing
MAX_CONNECTIONS = 4096
#: connections waiting for their scan past which a new one is given up (counted): a
#: reconnect storm must not grow the worker's queue without bound
MAX_PENDING_SCANS = 1024

#: what finds and watches the process of a connection (a /proc scan over loopback TCP)
Scanner = PeerScanner
#: the watch of one connection's process; pending, unknown or closed, it never says exited
WriterWatch = PeerWatch


class ConnectionProcesses(ConnectionPeers):
    """Each connection's :class:`WriterWatch`, its failed and given-up lookups counted as
    ``mp_peer_scan_failed`` / ``mp_peer_scan_given_up``, those naming no writer as
    ``mp_peer_foreign_namespace`` / ``mp_peer_not_writer``."""

    def __init__(self, scan: Scanner | None = None, *, arena: tuple[int, int] | None = None) -> None:
        """``arena``: the (device, inode) of the shared-memory segment a writer maps (None:
        no segment, so no process is checked for it); ``scan``: another scanner (tests)."""
        if scan is None:
            scan = watch_peer_socket if arena is None else partial(watch_writer_socket, arena=arena)
        super().__init__(
            scan,
            failed="mp_peer_scan_failed",
            given_up="mp_peer_scan_given_up",
            foreign="mp_peer_foreign_namespace",
            not_writer="mp_peer_not_writer",
            max_pending=MAX_PENDING_SCANS,
            max_connections=MAX_CONNECTIONS,
            thread_name="tiers-mp-peer-scan",
        )

    def writer(self, fd: int) -> WriterWatch | None:
        """The watch of the process at the other end of the connection whose message came
        in on descriptor ``fd`` (None: it cannot be told).  Never scans: a connection seen
        for the first time gets a pending watch, armed by the worker."""
        return self.watch(fd)
