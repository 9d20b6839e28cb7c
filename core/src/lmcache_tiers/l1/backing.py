"""Where L1 object bytes live: what the L1Manager needs from its storage.

Two backings exist: :class:`~lmcache_tiers.l1.arena.L1Arena` (shared memory, also
addressable as one buffer) and :class:`~lmcache_tiers.l1.nvme.NvmeL1File` (blocks of a file
on NVMe, reachable only by copying). Offsets and sizes are those of allocator extents.
"""

from __future__ import annotations

from typing import Protocol


class L1Backing(Protocol):
    @property
    def size(self) -> int: ...

    def read_into(self, offset: int, size: int, out: memoryview) -> None:
        """Copy ``size`` bytes at ``offset`` into ``out[:size]``."""

    def write_from(self, offset: int, data: memoryview) -> None:
        """Copy all of ``data`` to ``offset``."""

    def close(self) -> None: ...
