"""Byte accounting of an adapter: per key, in total and per ``cache_salt``; capacity checks.

Keys enter on a successful store, from the start-up scan of the backend's listing, or
lazily when a lookup finds a key this process does not know; they leave on delete, or when
the backend reports them gone: to a lookup, or to the check that follows a delete the
backend did not do (removed behind this adapter's back, e.g. by another server sharing
the store).  Stores are admitted against the capacity *before* they reach the backend and
reserve what they may add, so concurrent stores can never push usage over the capacity
together.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.protocols import Capacity, ObjectSize

__all__ = ["UNKNOWN_L1", "Admission", "ByteAccounting", "ObjectSize", "Verdict"]

#: ``ObjectSize.l1`` of an object listed by the backend whose L1 size is not known yet
#: (a size-changing serde chain and a listing that reports stored sizes only)
UNKNOWN_L1 = -1

#: keys touched while the scan runs that may be remembered beyond twice the keys accounted:
#: past that, those no longer accounted are forgotten and the scan lists the store again
TOUCHED_SLACK = 65536


class Verdict(enum.Enum):
    """What the capacity check says about one store."""

    ADMITTED = "admitted"
    FULL = "full"  # it does not fit under the capacity
    SCANNING = "scanning"  # it would add bytes while the usage is not known yet


@dataclass
class Admission:
    """Verdicts of one store batch and what it reserved until it is settled."""

    verdicts: list[Verdict]
    reserved_bytes: int = 0
    reserved_objects: int = 0
    settled: bool = field(default=False, repr=False)


class ByteAccounting:
    """Sizes of the objects an adapter knows of, and the capacity admission of stores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: dict[ObjectKey, ObjectSize] = {}
        self._total = 0
        self._by_salt: dict[str, int] = {}
        self._reserved_bytes = 0
        self._reserved_objects = 0
        self._scanning = False
        #: True once a start-up scan listed the whole store: from then on every object the
        #: backend holds is accounted, unless it was put there behind the adapter's back
        self.complete = False
        # Keys a live operation recorded, forgot or found absent while the scan ran: the
        # listing may be older than what the operation did or saw, so the scan leaves them
        # alone.  Kept past the scan's end while a lookup begun during it is still asking
        # (``_tracking``): its answer may release a key the scan accounted meanwhile, and
        # must tell those from keys a live operation recorded since.
        # Bounded (``_touch``): those of them no longer accounted are forgotten once they
        # outgrow the accounted keys, and the scan then reads a listing begun after that.
        self._touched: set[ObjectKey] = set()
        self._tracking = False
        #: set when touched keys were forgotten: the listing under way may bring them back
        self._relist_needed = False
        #: lookups begun while the scan ran and not finished yet
        self._scan_lookups = 0

    # -- internals (call with the lock held) --------------------------------------------------

    def _add(self, salt: str, delta: int) -> None:
        self._total += delta
        remaining = self._by_salt.get(salt, 0) + delta
        if remaining:
            self._by_salt[salt] = remaining
        else:
            self._by_salt.pop(salt, None)

    def _set(self, key: ObjectKey, size: ObjectSize) -> None:
        previous = self._sizes.get(key)
        self._sizes[key] = size
        self._add(key.cache_salt, size.stored - (previous.stored if previous else 0))
        if self._tracking:
            self._touch(key)

    def _touch(self, key: ObjectKey) -> None:
        """Remember that a live operation touched ``key`` while the scan runs.  A scan that
        trickles for hours under a churn of keys would remember every key stored and deleted
        meanwhile: past twice the accounted keys (and a slack), the touched keys no longer
        accounted are forgotten, and the listing under way is refused (``add_scanned``
        answers None) for one begun after that, which cannot hold what they removed."""
        self._touched.add(key)
        if len(self._touched) > 2 * len(self._sizes) + TOUCHED_SLACK:
            self._touched = {touched for touched in self._touched if touched in self._sizes}
            self._relist_needed = self._scanning

    # -- keys ---------------------------------------------------------------------------------

    def record(self, key: ObjectKey, size: ObjectSize) -> None:
        """Account ``key`` at ``size`` (replacing what it had, e.g. on overwrite)."""
        with self._lock:
            self._set(key, size)

    def record_many(self, items: Iterable[tuple[ObjectKey, ObjectSize]]) -> None:
        """``record`` for a whole batch under one acquisition of the lock."""
        with self._lock:
            for key, size in items:
                self._set(key, size)

    def record_if(self, key: ObjectKey, known: ObjectSize, size: ObjectSize) -> bool:
        """Account ``key`` at ``size`` if its entry is still ``known`` (the very object a
        caller read before asking the backend); False when a store replaced it meanwhile,
        and the backend's answer may predate that store."""
        with self._lock:
            if self._sizes.get(key) is not known:
                return False
            self._set(key, size)
            return True

    def record_if_absent(self, key: ObjectKey, size: ObjectSize) -> bool:
        with self._lock:
            if key in self._sizes:
                return False
            self._set(key, size)
            return True

    def forget(self, key: ObjectKey) -> ObjectSize | None:
        with self._lock:
            previous = self._sizes.pop(key, None)
            if previous is not None:
                self._add(key.cache_salt, -previous.stored)
            if self._tracking:
                self._touch(key)
            return previous

    def forget_if(self, key: ObjectKey, known: ObjectSize) -> bool:
        """Forget ``key`` if its entry is still ``known`` (the very object a caller read
        before asking the backend); False when a store or lookup replaced or removed it
        meanwhile, and the backend's answer may predate that."""
        with self._lock:
            if self._sizes.get(key) is not known:
                return False
            del self._sizes[key]
            self._add(key.cache_salt, -known.stored)
            if self._tracking:
                self._touch(key)
            return True

    def note_absent(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """The backend answered ``keys`` absent (not accounted when asked, by a lookup that
        began while the start-up scan ran): a scan still running must not account them
        from a listing older than that answer -- one read before another server sharing
        the store removed them.  Returns the keys it accounted while the backend was being
        asked (the scan may have ended since), released again here: no live operation
        touched them since the scan began, so only the scan can have."""
        if not keys or not self._tracking:
            return []
        released: list[ObjectKey] = []
        with self._lock:
            if not self._tracking:
                return []
            for key in keys:
                size = self._sizes.get(key)
                if size is not None and key not in self._touched:
                    del self._sizes[key]
                    self._add(key.cache_salt, -size.stored)
                    released.append(key)
                self._touch(key)
        return released

    def get(self, key: ObjectKey) -> ObjectSize | None:
        with self._lock:
            return self._sizes.get(key)

    def get_many(self, keys: Iterable[ObjectKey]) -> list[ObjectSize | None]:
        """``get`` for a whole batch under one acquisition of the lock."""
        with self._lock:
            return [self._sizes.get(key) for key in keys]

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._total

    def by_salt(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_salt)

    # -- the start-up scan ----------------------------------------------------------------------

    @property
    def scanning(self) -> bool:
        return self._scanning

    def begin_scan(self) -> None:
        with self._lock:
            self._scanning = True
            self._tracking = True
            self.complete = False
            self._touched.clear()
            self._relist_needed = False

    def begin_scan_lookup(self) -> bool:
        """A lookup is about to ask the backend; True if the scan runs, and the lookup must
        then call :meth:`end_scan_lookup` once it settled its answer (``note_absent``)."""
        with self._lock:
            if not self._scanning:
                return False
            self._scan_lookups += 1
            return True

    def end_scan_lookup(self) -> None:
        with self._lock:
            self._scan_lookups -= 1
            self._stop_tracking_if_done()

    def _stop_tracking_if_done(self) -> None:
        if not self._scanning and self._scan_lookups <= 0:
            self._tracking = False
            self._touched.clear()

    def add_scanned(
        self, items: Iterable[tuple[ObjectKey, ObjectSize]]
    ) -> tuple[list[ObjectKey], int] | None:
        """Account listed objects not known yet; returns the keys added and their bytes.
        None, accounting nothing, when keys touched meanwhile were forgotten (``_touch``):
        the scan must then read a listing begun after :meth:`relisting`."""
        added: list[ObjectKey] = []
        added_bytes = 0
        with self._lock:
            if self._relist_needed:
                return None
            for key, size in items:
                if key in self._sizes or key in self._touched:
                    continue
                self._sizes[key] = size
                self._add(key.cache_salt, size.stored)
                added.append(key)
                added_bytes += size.stored
        return added, added_bytes

    def relisting(self) -> None:
        """The scan is about to begin a new listing: what was forgotten happened before it."""
        with self._lock:
            self._relist_needed = False

    def end_scan(self, *, complete: bool = False) -> None:
        """The scan is over; ``complete``: it listed every stored object."""
        with self._lock:
            self._scanning = False
            self.complete = complete
            self._stop_tracking_if_done()

    # -- capacity ---------------------------------------------------------------------------------

    def usage(self, limit: Capacity | None) -> float:
        """Used fraction of the tighter limit; -1.0 without any."""
        if limit is None or (limit.bytes is None and limit.objects is None):
            return -1.0
        with self._lock:
            used, objects = self._total, len(self._sizes)
        fractions: list[float] = []
        for amount, bound in ((used, limit.bytes), (objects, limit.objects)):
            if bound is not None:
                fractions.append(amount / bound if bound > 0 else 1.0)
        return max(fractions)

    def admit(self, items: Sequence[tuple[ObjectKey, int]], limit: Capacity | None) -> Admission:
        """Check each store (key, stored bytes) of a batch, in order, against ``limit``.

        A store is admitted when the bytes and objects it adds fit next to what is
        accounted and what admitted stores still in flight may add.  An overwrite adds
        the difference to the object it replaces; one that shrinks an object frees
        nothing until it has succeeded, so a batch can never end above the capacity.
        While the start-up scan runs the usage is not known, and a store that would add
        anything is refused (``Verdict.SCANNING``).
        """
        if limit is None or (limit.bytes is None and limit.objects is None):
            return Admission([Verdict.ADMITTED] * len(items))
        verdicts: list[Verdict] = []
        claimed: dict[ObjectKey, int] = {}
        grow_bytes = grow_objects = 0
        with self._lock:
            for key, size in items:
                if key in claimed:
                    exists, base = True, claimed[key]
                else:
                    previous = self._sizes.get(key)
                    exists, base = previous is not None, previous.stored if previous else 0
                growth = max(0, size - base)
                new_object = 0 if exists else 1
                if self._scanning and (growth or new_object):
                    verdicts.append(Verdict.SCANNING)
                    continue
                bytes_fit = (
                    limit.bytes is None
                    or self._total + self._reserved_bytes + grow_bytes + growth <= limit.bytes
                )
                objects_fit = (
                    limit.objects is None
                    or len(self._sizes) + self._reserved_objects + grow_objects + new_object <= limit.objects
                )
                if not (bytes_fit and objects_fit):
                    verdicts.append(Verdict.FULL)
                    continue
                verdicts.append(Verdict.ADMITTED)
                claimed[key] = size
                grow_bytes += growth
                grow_objects += new_object
            self._reserved_bytes += grow_bytes
            self._reserved_objects += grow_objects
        return Admission(verdicts, grow_bytes, grow_objects)

    def settle(self, admission: Admission, stored: Iterable[tuple[ObjectKey, ObjectSize]]) -> None:
        """Account the stores that succeeded and release what the batch reserved (once)."""
        with self._lock:
            if not admission.settled:
                admission.settled = True
                self._reserved_bytes -= admission.reserved_bytes
                self._reserved_objects -= admission.reserved_objects
            for key, size in stored:
                self._set(key, size)
