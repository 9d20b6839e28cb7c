"""The bytes of pickled ``prepare_retrieve`` replies each connection has not taken off the
server yet.

A pickled retrieve's reply carries copies of its chunks, handed to libzmq without another
copy; libzmq queues them for the connection until the kernel takes them, up to a thousand
replies a connection, which a client that sends requests without reading its replies (a
hung engine, a stopped process) never lets it do: the server's memory grew by a reply per
request until the kernel killed it, and every other client with it.  Counted here from
the encoding until libzmq lets go of the reply (sent, or dropped), a connection holding
``max_message_mb`` or more of them is answered a miss instead (``mp_replies_unread``); a
client that reads its replies holds little when it asks again: its last reply, until
pyzmq's garbage thread lets go of it a moment after the kernel took it.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np


class UnreadReplies:
    """Per connection: bytes of pickled replies encoded and not yet let go by libzmq.

    Added on the pool's threads as they encode, given back by whichever thread drops the
    last reference to a reply (pyzmq's, once libzmq lets go of it): hence the lock.
    """

    def __init__(self, bound: int) -> None:
        #: bytes a connection may hold before its next pickled retrieve is refused (one
        #: reply is always served, whatever its size)
        self.bound = bound
        self._lock = threading.Lock()
        self._bytes: dict[bytes, int] = {}

    def held(self, peer: bytes) -> int:
        with self._lock:
            return self._bytes.get(peer, 0)

    def over_bound(self, peer: bytes) -> bool:
        return self.held(peer) >= self.bound

    def track(self, peer: bytes, reply: bytes) -> np.ndarray:
        """``reply`` as the array sent in its place, counted until nothing holds it."""
        array = np.frombuffer(reply, dtype=np.uint8)
        with self._lock:
            self._bytes[peer] = self._bytes.get(peer, 0) + array.nbytes
        weakref.finalize(array, self._give_back, peer, array.nbytes)
        return array

    def _give_back(self, peer: bytes, nbytes: int) -> None:
        with self._lock:
            left = self._bytes.get(peer, 0) - nbytes
            if left > 0:
                self._bytes[peer] = left
            else:
                self._bytes.pop(peer, None)
