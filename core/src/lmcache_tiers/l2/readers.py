"""Reader counts of the slots of a slot store: a slot is never reused under a load.

Stores that keep objects in preallocated slots (``raw_block``, ``dax``, ``nixl_store``)
count the loads reading each slot.  A slot whose object goes away (replaced by a newer
write of its key, deleted, found damaged) while loads still read it is *retired*: it
returns to the free list only when its last reader leaves, so its bytes never change
under a copy in flight.  The owner's lock guards this table (it has none of its own).
"""

from __future__ import annotations

__all__ = ["SlotReaders"]


class SlotReaders:
    """Per-slot reader counts and the retired slots waiting for their readers."""

    __slots__ = ("_counts", "_retired")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._retired: set[int] = set()

    def acquire(self, slot: int) -> None:
        """One more load reads ``slot``."""
        self._counts[slot] = self._counts.get(slot, 0) + 1

    def reading(self, slot: int) -> bool:
        """Whether a load is reading ``slot`` now."""
        return slot in self._counts

    def retire(self, slot: int) -> bool:
        """``slot`` no longer holds a live object: True when it may be freed now, False
        when it is read and waits for :meth:`release` to say so."""
        if slot in self._counts:
            self._retired.add(slot)
            return False
        return True

    def release(self, slot: int) -> bool:
        """A load of ``slot`` finished: True when it was the last reader of a retired
        slot, which the caller frees now."""
        remaining = self._counts[slot] - 1
        if remaining:
            self._counts[slot] = remaining
            return False
        del self._counts[slot]
        if slot in self._retired:
            self._retired.remove(slot)
            return True
        return False

    @property
    def retired(self) -> frozenset[int]:
        """Slots waiting for their readers to leave."""
        return frozenset(self._retired)
