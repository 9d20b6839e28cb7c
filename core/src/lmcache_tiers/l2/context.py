"""What an adapter factory receives besides its own config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.serde import Serde


def buffer_address(buffer: memoryview) -> int:
    """Virtual address of a buffer's first byte (read-only buffers too)."""
    # numpy reads the address through the buffer protocol without copying and, unlike
    # ctypes.from_buffer, accepts read-only views.
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


@dataclass(frozen=True)
class AdapterContext:
    """Runtime facts about one configured adapter, built by the StorageManager."""

    #: position of the adapter in the configured cascade (0 first)
    index: int
    #: instance label, e.g. ``"0:mock"``; used in logs, metrics and thread names
    name: str
    #: the adapter's decoded config (the same object the factory gets first)
    config: L2AdapterConfig
    #: serde chain in encoding order; the base classes apply it
    serde: Sequence[Serde] = field(default_factory=tuple)
    #: the whole L1 arena, for backends that register memory once (NIXL); None in tests
    #: that run an adapter without an L1
    l1_buffer: memoryview | None = None
    #: True when ``l1_buffer`` is ordinary host memory (DRAM) that may be registered as
    #: such; False if it is device memory or of unknown kind
    l1_is_memory: bool = True

    def l1_offset(self, buffer: memoryview) -> int | None:
        """Offset of ``buffer`` inside the L1 arena, or None if it lies (partly) outside."""
        if self.l1_buffer is None or buffer.nbytes == 0:
            return None
        offset = buffer_address(buffer) - buffer_address(self.l1_buffer)
        if offset >= 0 and offset + buffer.nbytes <= self.l1_buffer.nbytes:
            return offset
        return None
