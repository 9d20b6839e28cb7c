"""Slot bookkeeping of nixl_store: which preallocated slot holds which key.

A slot is claimed before its bytes are written and published only once the write has
succeeded, so a lookup never reports an object still in flight.  Storing a key again
writes a fresh slot and retires the old one.  Loads count readers per slot; a slot with
readers is never handed to a new object (a delete of its key is refused, a retired slot
waits for its last reader), so bytes are never overwritten while being read out.  Each
stored slot keeps the checksum of the bytes written into it, which a load verifies before
its buffer counts as loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from lmcache_tiers.plugin import ObjectKey, SlotReaders


class Claim(Enum):
    """Why a store got no slot."""

    BUSY = "busy"  # another store of the same key is still writing it
    FULL = "full"  # no free slot left


@dataclass(frozen=True)
class StoredSlot:
    slot: int
    size: int
    digest: bytes  # XXH3-128 of the bytes the store wrote


class SlotTable:
    """Thread-safe map of keys to slots with a free list and per-slot reader counts."""

    def __init__(self, pool_size: int) -> None:
        self.pool_size = pool_size
        # Lowest slots first, so a lightly used pool touches few files.
        self._free = list(range(pool_size - 1, -1, -1))
        self._stored: dict[ObjectKey, StoredSlot] = {}
        self._writing: set[ObjectKey] = set()
        # Retired: slots replaced by a newer write of their key while a load read them.
        self._readers = SlotReaders()
        self._lock = threading.Lock()

    def claim(self, keys: Sequence[ObjectKey]) -> list[int | Claim]:
        """A free slot per key to write into, or why there is none."""
        result: list[int | Claim] = []
        with self._lock:
            for key in keys:
                if key in self._writing:
                    result.append(Claim.BUSY)
                elif not self._free:
                    result.append(Claim.FULL)
                else:
                    self._writing.add(key)
                    result.append(self._free.pop())
        return result

    def publish(self, key: ObjectKey, slot: int, size: int, digest: bytes) -> None:
        with self._lock:
            self._writing.discard(key)
            previous = self._stored.get(key)
            self._stored[key] = StoredSlot(slot, size, digest)
            if previous is not None:
                self._free_or_retire(previous.slot)

    def _free_or_retire(self, slot: int) -> None:
        if self._readers.retire(slot):
            self._free.append(slot)

    def abandon(self, key: ObjectKey, slot: int) -> None:
        """Give back a claimed slot whose write failed."""
        with self._lock:
            self._writing.discard(key)
            self._free.append(slot)

    def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        with self._lock:
            return [entry.size if (entry := self._stored.get(key)) else None for key in keys]

    def sizes_now(self, keys: Sequence[ObjectKey]) -> list[int | None] | None:
        """``sizes`` without waiting: None when another thread holds the lock."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return [entry.size if (entry := self._stored.get(key)) else None for key in keys]
        finally:
            self._lock.release()

    def acquire_for_read(self, keys: Sequence[ObjectKey]) -> list[StoredSlot | None]:
        """The slot of each stored key, counted as read until :meth:`release_reads`."""
        result: list[StoredSlot | None] = []
        with self._lock:
            for key in keys:
                entry = self._stored.get(key)
                if entry is not None:
                    self._readers.acquire(entry.slot)
                result.append(entry)
        return result

    def drop_damaged(self, key: ObjectKey, slot: int) -> bool:
        """Forget ``key`` whose bytes in ``slot`` failed their checksum, unless it was
        stored again meanwhile (True when dropped).  The slot is retired: the caller
        still reads it, and :meth:`release_reads` frees it."""
        with self._lock:
            entry = self._stored.get(key)
            if entry is None or entry.slot != slot:
                return False
            del self._stored[key]
            self._free_or_retire(slot)
            return True

    def release_reads(self, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                if self._readers.release(slot):
                    self._free.append(slot)

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Free the slots of stored keys; keys being read or not stored are skipped."""
        result: list[bool] = []
        with self._lock:
            for key in keys:
                entry = self._stored.get(key)
                if entry is None or self._readers.reading(entry.slot):
                    result.append(False)
                    continue
                del self._stored[key]
                self._free.append(entry.slot)
                result.append(True)
        return result

    def items(self) -> list[tuple[ObjectKey, int]]:
        """Every stored key with its size."""
        with self._lock:
            return [(key, entry.size) for key, entry in self._stored.items()]

    @property
    def used_slots(self) -> int:
        """Slots not free: stored, being written, or retired and still being read."""
        with self._lock:
            return self.pool_size - len(self._free)

    @property
    def stored_bytes(self) -> int:
        with self._lock:
            return sum(entry.size for entry in self._stored.values())
