"""The bytes of inline RETRIEVE replies each connection has not taken off the server yet.

An inline reply's payloads are copies of L1 objects, handed to libzmq without another
copy; libzmq queues them for the connection until the kernel takes them, which a client
that sends requests without reading its replies never lets it do.  Counted here from the
copy until libzmq lets go of the payload (sent, or dropped), a connection past its bound
is refused further inline RETRIEVEs, instead of the server's memory growing by up to the
largest inline reply per request until the kernel kills it, and every other client with
it.  A client that reads its replies holds little when it asks again: its last replies,
until pyzmq's garbage thread lets go of them a moment after the kernel took them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

#: unsent inline replies of the largest size a connection may have queued before more are
#: refused: a client's threads each wait for their own reply, which leaves the queue as
#: fast as the client reads, so only requests sent without reading replies reach it
REPLIES_PER_CONNECTION = 4


class UnsentInlineBytes:
    """Per connection identity: bytes of inline replies being built or queued for it.

    Added on the pool's threads as they copy, given back by whichever thread drops the
    last reference to a payload (pyzmq's, once libzmq lets go of it): hence the lock.
    """

    def __init__(self, largest_reply: int) -> None:
        self.largest_reply = largest_reply
        self.bound = REPLIES_PER_CONNECTION * largest_reply
        self._lock = threading.Lock()
        self._bytes: dict[bytes, int] = {}

    def held(self, identity: bytes) -> int:
        with self._lock:
            return self._bytes.get(identity, 0)

    def add(self, identity: bytes, nbytes: int) -> None:
        with self._lock:
            self._bytes[identity] = self._bytes.get(identity, 0) + nbytes

    def give_back(self, identity: bytes, nbytes: int) -> None:
        with self._lock:
            left = self._bytes.get(identity, 0) - nbytes
            if left > 0:
                self._bytes[identity] = left
            else:
                self._bytes.pop(identity, None)

    def track(self, identity: bytes, payload: Any) -> np.ndarray:
        """``payload`` as the array sent in its place, counted until nothing holds it."""
        array = np.frombuffer(payload, dtype=np.uint8)
        self.add(identity, array.nbytes)
        weakref.finalize(array, self.give_back, identity, array.nbytes)
        return array
