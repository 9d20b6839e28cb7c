"""Where everything lies in one mapped DAX device or file (pure arithmetic, no I/O).

``[0, 4096)`` superblock | index: one 4096-byte entry per slot | slot data, each slot
``slot_bytes`` long, starting at ``data_offset``.

An index entry is a commit word (u64: the sequence number of the write the slot holds,
0 for a free slot) followed by the slot header (``lmcache_plugin_raw_block.slotheader``:
device identity, slot, write, key, sizes, core's record header).  Entries are a page
each so that a torn page write can damage one entry at most.  The data region starts on
a 2 MiB boundary on mappings of 256 MiB and more (huge pages of a device DAX), on a page
boundary on smaller ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Final

SUPERBLOCK_BYTES: Final = 4096
ENTRY_BYTES: Final = 4096
#: bytes of an entry before the slot header
COMMIT_BYTES: Final = 8
PAGE: Final = 4096
HUGE_PAGE: Final = 2 << 20
_GIB = 1 << 30


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


@dataclass(frozen=True)
class DaxLayout:
    mapped_bytes: int
    slot_bytes: int
    slot_count: int
    index_offset: int
    data_offset: int

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "entry_bytes": ENTRY_BYTES}

    def entry_offset(self, local: int) -> int:
        return self.index_offset + local * ENTRY_BYTES

    def slot_offset(self, local: int) -> int:
        return self.data_offset + local * self.slot_bytes


def mapped_bytes(max_dax_size_gb: float, *, device: bool) -> int:
    """The bytes mapped for ``max_dax_size_gb``: whole pages, whole huge pages on a device."""
    size = int(max_dax_size_gb * _GIB)
    return size - size % (HUGE_PAGE if device else PAGE)


def plan_layout(size: int, slot_bytes: int) -> DaxLayout:
    """The layout of a mapping of ``size`` bytes (``slot_count`` is 0 if no slot fits)."""
    align = HUGE_PAGE if size >= 256 << 20 else PAGE
    count = max(0, (size - SUPERBLOCK_BYTES) // (slot_bytes + ENTRY_BYTES))

    def data_offset(slots: int) -> int:
        return _round_up(SUPERBLOCK_BYTES + slots * ENTRY_BYTES, align)

    while count and data_offset(count) + count * slot_bytes > size:
        count -= 1
    return DaxLayout(size, slot_bytes, count, SUPERBLOCK_BYTES, data_offset(count))
