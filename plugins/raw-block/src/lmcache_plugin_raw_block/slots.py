"""Which fixed-size slot holds which key, for the slot stores (``raw_block`` and ``dax``).

Every write gets a fresh slot and a sequence number from one counter that only grows; the
sequence number is written into the slot's header and is the slot's generation: a reader
that finds it unchanged after copying knows the slot was not reused under it.  A key is
published only after its slot was written, so a lookup never reports an object still in
flight; publishing again retires the key's previous slot.  Reader counts keep a slot
from changing hands while it is read: a slot replaced, deleted or found corrupt while a
load reads it goes back to the free list only when its last reader leaves.

Free slots are handed out lowest number first.  ``raw_block`` relies on it: the slots
written after a checkpoint that were free at the checkpoint are then the lowest ones of
that checkpoint's free set, so recovery finds them by scanning it in order (see
``recovery.py``).  Slots that are neither published nor free at a snapshot (claimed,
retired, quarantined) are listed in it as *watched*, so recovery checks them one by one.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lmcache_tiers.plugin import ObjectKey, SlotReaders

#: slots a store claims and writes per round of a batch; with one store thread, the most
#: writes in flight at once (raw_block's recovery relies on it)
CLAIM_GROUP = 64


@dataclass(frozen=True, slots=True)
class SlotEntry:
    """A published object: its slot, the write's sequence number and its two sizes."""

    slot: int
    seq: int
    stored: int  # payload bytes in the slot (after the serde chain)
    l1: int  # bytes in L1 (before the serde chain)


@dataclass(frozen=True, slots=True)
class Claim:
    """A free slot taken for one write, and the sequence number that write carries."""

    slot: int
    seq: int


@dataclass(frozen=True)
class Snapshot:
    """The table at one instant, for a checkpoint."""

    entries: list[tuple[ObjectKey, SlotEntry]]
    #: slots neither published nor free, with the lowest sequence number a write into
    #: them may carry that the snapshot does not already account for
    watched: list[tuple[int, int]]
    #: the sequence number the next claim gets
    next_seq: int
    #: ``SlotTable.version`` when the snapshot was taken
    version: int
    #: the quarantined slots among ``watched``
    quarantined: frozenset[int] = frozenset()


class SlotTable:
    """Thread-safe map of keys to slots with a lowest-first free list and reader counts.

    ``on_free(slot)`` is called (under the table's lock, so it must be quick) whenever a
    slot that held a published object becomes free; ``on_unpublish(slot)`` (likewise)
    as soon as a written slot stops being its key's object (replaced, deleted, found
    damaged, or beaten by a newer write), readers or not.  ``dax`` clears the slot's
    commit word then: a restart (or a crash) while an old write is still read must not
    bring it back once its newer write is gone too.
    """

    def __init__(
        self,
        slot_count: int,
        *,
        next_seq: int = 1,
        on_free: Callable[[int], None] | None = None,
        on_unpublish: Callable[[int], None] | None = None,
    ) -> None:
        if slot_count < 1:
            raise ValueError("a slot table needs at least one slot")
        self.slot_count = slot_count
        self._on_free = on_free
        self._on_unpublish = on_unpublish
        self._lock = threading.Lock()
        self._free = list(range(slot_count))  # sorted, hence already a heap
        self._stored: dict[ObjectKey, SlotEntry] = {}
        self._claimed: dict[int, int] = {}  # slot -> seq of the write in flight
        self._readers = SlotReaders()  # retired: no longer published, still being read
        self._quarantined: set[int] = set()  # failed a write; left alone until restart
        self._unsaved_quarantines: set[int] = set()  # ... and not yet in a saved snapshot
        self._next_seq = next_seq
        #: grows with every change a checkpoint would record
        self.version = 0

    # -- recovery --------------------------------------------------------------------------

    def restore(self, entries: Iterable[tuple[ObjectKey, SlotEntry]], next_seq: int) -> list[SlotEntry]:
        """Load recovered objects into an empty table; returns the entries that lost to a
        newer write of the same key (their slots stay free)."""
        with self._lock:
            if self._stored or self._claimed:
                raise RuntimeError("restore() needs an empty table")
            superseded: list[SlotEntry] = []
            taken: set[int] = set()
            for key, entry in entries:
                if not 0 <= entry.slot < self.slot_count or entry.slot in taken:
                    raise ValueError(f"slot {entry.slot} restored twice or out of range")
                current = self._stored.get(key)
                if current is not None and current.seq >= entry.seq:
                    superseded.append(entry)
                    continue
                if current is not None:
                    superseded.append(current)
                    taken.discard(current.slot)
                self._stored[key] = entry
                taken.add(entry.slot)
            self._free = [slot for slot in range(self.slot_count) if slot not in taken]
            newest = max((entry.seq for entry in self._stored.values()), default=0)
            self._next_seq = max(next_seq, newest + 1, self._next_seq)
            self.version += 1
            return superseded

    # -- writes ----------------------------------------------------------------------------

    def claim(self, count: int) -> list[Claim]:
        """Up to ``count`` free slots, lowest first, each with a new sequence number."""
        claims: list[Claim] = []
        with self._lock:
            while self._free and len(claims) < count:
                slot = heapq.heappop(self._free)
                claims.append(Claim(slot, self._next_seq))
                self._claimed[slot] = self._next_seq
                self._next_seq += 1
        return claims

    def publish(self, key: ObjectKey, entry: SlotEntry) -> bool:
        """Make a written slot the key's object; False when a newer write of the key was
        published meanwhile (this slot is then freed instead)."""
        with self._lock:
            self._claimed.pop(entry.slot, None)
            current = self._stored.get(key)
            self.version += 1
            if current is not None and current.seq > entry.seq:
                self._release_slot(entry.slot)
                return False
            self._stored[key] = entry
            if current is not None:
                self._release_slot(current.slot)
            return True

    def abandon(self, claim: Claim, *, quarantine: bool = False) -> None:
        """Give back a claimed slot whose write failed; ``quarantine`` keeps it out of use
        (a device error there) until the table is rebuilt at the next start."""
        with self._lock:
            self._claimed.pop(claim.slot, None)
            if quarantine:
                self._quarantined.add(claim.slot)
                self._unsaved_quarantines.add(claim.slot)
                self.version += 1
            else:
                heapq.heappush(self._free, claim.slot)

    def _release_slot(self, slot: int) -> None:
        """A slot that held a published object: free now, or once its readers are gone."""
        if self._on_unpublish is not None:
            self._on_unpublish(slot)
        if not self._readers.retire(slot):
            return
        self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        if self._on_free is not None:
            self._on_free(slot)
        heapq.heappush(self._free, slot)

    # -- reads -----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ObjectKey]) -> list[SlotEntry | None]:
        with self._lock:
            return [self._stored.get(key) for key in keys]

    def lookup_now(self, keys: Sequence[ObjectKey]) -> list[SlotEntry | None] | None:
        """``lookup`` without waiting: None when another thread holds the lock."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return [self._stored.get(key) for key in keys]
        finally:
            self._lock.release()

    def acquire(self, keys: Sequence[ObjectKey]) -> list[SlotEntry | None]:
        """Each key's entry, its slot counted as read until :meth:`release`."""
        result: list[SlotEntry | None] = []
        with self._lock:
            for key in keys:
                entry = self._stored.get(key)
                if entry is not None:
                    self._readers.acquire(entry.slot)
                result.append(entry)
        return result

    def release(self, entries: Iterable[SlotEntry | None]) -> None:
        with self._lock:
            for entry in entries:
                if entry is not None and self._readers.release(entry.slot):
                    self._free_slot(entry.slot)

    def is_current(self, key: ObjectKey, entry: SlotEntry) -> bool:
        """Whether ``entry`` is still the key's published object."""
        with self._lock:
            return self._stored.get(key) == entry

    # -- removal ---------------------------------------------------------------------------

    def discard(self, key: ObjectKey, entry: SlotEntry) -> bool:
        """Unpublish a damaged object if ``entry`` is still the key's; its slot is freed
        once its readers are gone.  False when a newer write replaced it already."""
        with self._lock:
            if self._stored.get(key) != entry:
                return False
            del self._stored[key]
            self.version += 1
            self._release_slot(entry.slot)
            return True

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Free the slots of published keys; a key whose slot is being read is kept."""
        result: list[bool] = []
        with self._lock:
            for key in keys:
                entry = self._stored.get(key)
                if entry is None or self._readers.reading(entry.slot):
                    result.append(False)
                    continue
                del self._stored[key]
                self.version += 1
                self._release_slot(entry.slot)
                result.append(True)
        return result

    # -- views -----------------------------------------------------------------------------

    def with_held_slots(self, action: Callable[[npt.NDArray[np.int64]], None]) -> None:
        """Call ``action`` with every slot published or claimed, under the table's lock:
        no other slot is claimed or published until it returns (it must be quick and must
        not call the table)."""
        with self._lock:
            held = [entry.slot for entry in self._stored.values()]
            held += list(self._claimed)
            action(np.asarray(held, dtype=np.int64))

    def items(self) -> list[tuple[ObjectKey, SlotEntry]]:
        with self._lock:
            return list(self._stored.items())

    def snapshot(self) -> Snapshot:
        with self._lock:
            watched = list(self._claimed.items())
            watched += [(slot, self._next_seq) for slot in self._readers.retired | self._quarantined]
            return Snapshot(
                list(self._stored.items()),
                sorted(watched),
                self._next_seq,
                self.version,
                frozenset(self._quarantined),
            )

    def saved(self, snapshot: Snapshot) -> None:
        """``snapshot`` is on the device now (a checkpoint): its quarantined slots are
        watched there, no longer among the slots it lists as free."""
        with self._lock:
            self._unsaved_quarantines -= snapshot.quarantined

    @property
    def unsaved_quarantines(self) -> int:
        """Slots quarantined since the last saved snapshot."""
        with self._lock:
            return len(self._unsaved_quarantines)

    @property
    def used_slots(self) -> int:
        """Slots not free: published, being written, retired and still read, quarantined."""
        with self._lock:
            return self.slot_count - len(self._free)

    @property
    def quarantined_slots(self) -> int:
        with self._lock:
            return len(self._quarantined)
