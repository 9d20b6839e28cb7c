"""Where L1 object bytes live: what the L1Manager needs from its storage.

Two backings exist: :class:`~lmcache_tiers.l1.arena.L1Arena` (shared memory, also
addressable as one buffer) and :class:`~lmcache_tiers.l1.nvme.NvmeL1File` (blocks of a file
on NVMe, reachable only by copying). Offsets and sizes are those of allocator extents.
"""

from __future__ import annotations

from typing import Protocol

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l1.arena import L1Arena
from lmcache_tiers.l1.nvme import DIRECT_IO_ALIGN, NvmeL1File
from lmcache_tiers.tmpfs import SHM_DIR


class L1Backing(Protocol):
    @property
    def size(self) -> int: ...

    def read_into(self, offset: int, size: int, out: memoryview) -> None:
        """Copy ``size`` bytes at ``offset`` into ``out[:size]``."""

    def write_from(self, offset: int, data: memoryview) -> None:
        """Copy all of ``data`` to ``offset``."""

    def close(self) -> None: ...


def open_backing(
    capacity: int,
    align: int,
    *,
    shm_name: str | None,
    shm_dir: str = SHM_DIR,
    prefault: bool,
    pin: bool,
    nvme_path: str | None,
    direct_io: bool,
) -> tuple[L1Backing, L1Arena | None]:
    """The backing of an L1 of ``capacity`` bytes in extents of ``align``: a shared-memory
    arena in ``shm_dir`` (returned twice: it is also the arena), or the NVMe file under ``nvme_path``."""
    if nvme_path is None:
        # One generation per allocation unit: every extent starts on a unit boundary.
        arena = L1Arena(
            capacity, name=shm_name, prefault=prefault, pin=pin, generation_block=align, directory=shm_dir
        )
        return arena, arena
    if align % DIRECT_IO_ALIGN:
        raise ConfigError(
            f"an NVMe L1 needs an alignment that is a multiple of {DIRECT_IO_ALIGN}, got {align}"
        )
    return NvmeL1File(nvme_path, capacity, direct_io=direct_io), None
