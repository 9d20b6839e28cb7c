"""Python client of the lmcache-tiers server, used by engines, tests and benchmarks.

::

    from lmcache_tiers.client import Client

    with Client("tcp://127.0.0.1:5555") as client:
        client.store(keys, tensors)               # bytes, memoryview, numpy, torch CPU
        hits = client.lookup(keys, timeout=5.0)   # prefix hits in L1+L2, waits for prefetch
        with client.retrieve(keys[:hits]) as views:
            for view, out in zip(views, outputs):
                out[:] = view                       # one copy out of the server's memory

On the same host the client maps the server's L1 shared-memory segment: a store reserves
extents, copies the caller's bytes in and commits; a retrieve read-locks objects, hands out
read-only views into the segment and releases the locks when the ``with`` block ends, so
no payload byte crosses the socket.  Elsewhere (or with ``shm=False``) the bytes travel
inline in the messages and the same calls work unchanged.

A ``lookup`` leaves its hit prefix read-locked for this client so the objects cannot be
evicted before they are retrieved; ``retrieve`` (on exit) and ``release`` drop those
locks, and the server's lock TTL reclaims them from a client that never does.

A shared-memory view is valid while its lock lives (its *lease*).  The server never
reuses a locked extent, and holds it back for a while even when a lock was broken (a
forced clear, the lock TTL); should a reader still outlast that, the segment's
generation table shows the extent changed hands, and ``retrieve`` raises
:class:`StaleReadError` at the end of its block (``retrieve_into`` retries first)
instead of letting wrong bytes pass as the object's.

A server that restarts at the same address is followed: the socket reconnects by
itself, and before the next store or retrieve the client greets the server again and maps
the segment it offers now, so offsets of the new server are never read from, or written
into, the old one's memory (a request answered across the restart is given back and sent
again once).

One Client is one ZeroMQ socket: calls are serialized with a lock, so sharing a client
between threads is safe but not parallel; use one client per thread for parallelism.
"""

from lmcache_tiers.client.api import Client
from lmcache_tiers.client.connection import AUTH_TOKEN_ENV
from lmcache_tiers.client.errors import (
    ClientError,
    ConnectionLostError,
    ProtocolError,
    RequestTimeoutError,
    ServerError,
    StaleReadError,
)

__all__ = [
    "AUTH_TOKEN_ENV",
    "Client",
    "ClientError",
    "ConnectionLostError",
    "ProtocolError",
    "RequestTimeoutError",
    "ServerError",
    "StaleReadError",
]
