"""Where record headers are read to: lanes of one memory region registered with Mooncake.

Every object is core's record -- a header of exactly ``HEADER_BYTES`` (padded), then the
payload -- so the payload of a load lands straight in its L1 buffer and only the header
needs memory of its own.  A fixed header size is what lets any server split a record
without reading it first, whatever key, layout or serde chain wrote it.

Mooncake reads byte ranges (a lookup reading headers only) only into memory registered
with its client, and registering is slow, so the region is registered once per client and
carved into lanes of ``KEYS_PER_LANE`` headers.  A call takes one lane per
``KEYS_PER_LANE`` keys and gives it back when Mooncake is done with it -- which, for a
call given up at its deadline, is when the call finally ends, never earlier.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from lmcache_tiers.plugin import TiersError

#: every record's header is padded to exactly this many bytes
HEADER_BYTES = 4096
#: keys one Mooncake call handles at most (larger batches take several calls): each call
#: asks the master once, and payload checksums run between calls, not during them, so
#: fewer and larger calls are faster (a lane holds 1 MiB of headers)
KEYS_PER_LANE = 256

__all__ = ["HEADER_BYTES", "KEYS_PER_LANE", "HeaderLanes", "Lane", "address_of", "chunks"]


def address_of(buffer: memoryview | bytes) -> int:
    """Virtual address of a buffer's first byte (read-only buffers too)."""
    # numpy reads the address through the buffer protocol without copying; ctypes'
    # from_buffer refuses read-only views (L1 extents lent for a store are read-only).
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def chunks(count: int, size: int = KEYS_PER_LANE) -> Iterator[range]:
    """Index ranges of at most ``size`` covering ``range(count)``."""
    for start in range(0, count, size):
        yield range(start, min(start + size, count))


class Lane:
    """``KEYS_PER_LANE`` header slots of the registered region."""

    def __init__(self, view: memoryview, address: int) -> None:
        self._view = view
        self._address = address

    def slot(self, index: int) -> memoryview:
        start = index * HEADER_BYTES
        return self._view[start : start + HEADER_BYTES]

    def address(self, index: int) -> int:
        return self._address + index * HEADER_BYTES


class HeaderLanes:
    """A fixed set of lanes in one anonymous mapping, taken and given back by callers."""

    def __init__(self, lanes: int) -> None:
        lane_bytes = KEYS_PER_LANE * HEADER_BYTES
        self.size = lanes * lane_bytes
        self._memory = mmap.mmap(-1, self.size)
        self._view = memoryview(self._memory)
        self._view[:] = bytes(self.size)  # fault the pages in once, not on every first read
        self.address = address_of(self._view)
        self._free = [
            Lane(self._view[i * lane_bytes : (i + 1) * lane_bytes], self.address + i * lane_bytes)
            for i in range(lanes)
        ]
        self._available = threading.Condition()

    @property
    def free(self) -> int:
        with self._available:
            return len(self._free)

    def take(self, timeout: float) -> Lane:
        """A free lane; ``TiersError`` if none is given back within ``timeout``."""
        with self._available:
            if not self._available.wait_for(lambda: self._free, timeout):
                raise TiersError(f"no header lane free within {timeout:g}s (calls are stuck in Mooncake)")
            return self._free.pop()

    def give_back(self, lane: Lane) -> None:
        with self._available:
            self._free.append(lane)
            self._available.notify()

    @contextmanager
    def lane(self, timeout: float) -> Iterator[Lane]:
        """A lane for a call that finishes before the block ends (not a given-up one)."""
        taken = self.take(timeout)
        try:
            yield taken
        finally:
            self.give_back(taken)
