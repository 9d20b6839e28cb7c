"""A peer holding the routing identities an unseeded libzmq ROUTER would hand out next.

libzmq numbers the connections of peers that choose no identity from a start drawn from
the C library's ``rand()``; unseeded, the first ROUTER of a process starts at
:data:`UNSEEDED_START`.  It aborts the process when it hands a new connection an identity
a peer chose, so a front end's tests claim the next identities, then connect ordinary
clients, and check the server lives on (see ``router._seed_routing_ids``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import zmq

__all__ = ["UNSEEDED_START", "identities_claimed"]

#: where an unseeded C library's rand() starts libzmq's numbering: the first ROUTER made in
#: a process hands out 006b8b4567 first, and a server makes only a few
UNSEEDED_START = 0x6B8B4567


@contextlib.contextmanager
def identities_claimed(url: str, probe: Sequence[bytes], count: int = 256) -> Iterator[None]:
    """``count`` connections to ``url`` under the identities from :data:`UNSEEDED_START` on,
    each having sent ``probe`` (a request of the front end's protocol) and waited briefly
    for its answer -- connected, answered or turned away as a duplicate -- until the block
    ends."""
    context = zmq.Context()
    claimed = []
    try:
        for number in range(UNSEEDED_START, UNSEEDED_START + count):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, b"\x00" + number.to_bytes(4, "big"))
            sock.connect(url)
            claimed.append(sock)
        for sock in claimed:
            sock.send_multipart(list(probe))
            sock.poll(2000)
        yield
    finally:
        for sock in claimed:
            sock.close(0)
        context.term()
