"""The four batch operations, each split around its backend call.

``prepare`` takes pins, encodes and checks capacity (no backend I/O); the runner makes
the backend call (on a worker thread or the event loop); ``finish`` accounts, decodes,
notifies listeners and builds the result.  ``finish(None)`` means the backend call failed
and releases whatever ``prepare`` took.  ``released`` undoes what a *successful* result
still holds when that result is refused because ``close()`` already failed the task.

The rules every adapter follows live here, once:

* a lookup pins each hit; a load holds its own pin while it runs; a delete skips pinned
  keys, and a key being deleted is never reported found;
* a store and a delete of the same key never overlap (``PinTable``): a delete skips a key
  a store is writing (``delete_skipped_storing``), a store skips a key being deleted
  (``store_skipped_deleting``); a store keeps its claim until it has accounted the key
  and told listeners, a delete until it has forgotten it and told them;
* bytes are accounted on a successful store, from the start-up scan, on the first lookup
  hit of a key not known yet (announced to listeners as stored, ``lookup_adopted``), and
  are released on delete or when the backend reports an
  accounted key gone -- to a lookup, or to the check after a delete it did not do
  (``AbsenceCheckOp``): removed behind the adapter's back, counted as ``objects_vanished``
  and announced to listeners as deleted;
* a key a delete did not remove that the adapter never accounted (listed by the store,
  e.g. stored by another server after the start-up scan) is checked too: found absent,
  it is counted as ``delete_keys_absent`` and announced through the optional
  ``on_l2_keys_absent`` -- not as deleted, since no store of it was ever announced;
* serde and capacity refusals fail one object, backend exceptions the whole batch.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_tiers.errors import plugin_code
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.accounting import UNKNOWN_L1, Admission, Verdict
from lmcache_tiers.l2.codec import SerdeBoundError, Staged
from lmcache_tiers.l2.interface import L2Op, LoadResult, LookupResult
from lmcache_tiers.l2.pins import Claim
from lmcache_tiers.l2.state import AdapterState, impossible_size
from lmcache_tiers.protocols import Capacity, ObjectSize

log = logging.getLogger("lmcache_tiers.l2")

Found = int | ObjectSize | None


class BatchOp(ABC):
    """One submitted batch: ``prepare`` -> backend call -> ``finish``."""

    #: the backend method this operation calls
    method: str
    #: the task kind it runs as (None: ``delete``, which runs on the caller's thread)
    kind: L2Op | None = None
    #: prepare / finish do CPU-heavy serde work (an event loop runs them off the loop)
    heavy_prepare = False
    heavy_finish = False

    def __init__(self, state: AdapterState, keys: Sequence[ObjectKey]) -> None:
        self.state = state
        self.keys = list(keys)
        #: positions of the keys that reach the backend call
        self.io_index: list[int] = []

    def io_keys(self) -> list[ObjectKey]:
        return [self.keys[i] for i in self.io_index]

    @abstractmethod
    def prepare(self) -> tuple[Any, ...]:
        """Everything before the backend call; returns the call's arguments."""

    @abstractmethod
    def finish(self, io_result: Sequence[Any] | None, *, call_returned: bool = True) -> Any:
        """Account, decode, notify; ``io_result`` None means the backend call failed.

        ``call_returned`` is False when the call was abandoned (cancelled on close) and
        may still touch its buffers: staging memory is then not reused.
        """

    def released(self) -> None:
        """The result was refused (task already failed by close): undo what is held."""
        return None  # optional hook: nothing held by default


def _release(staged: Sequence[Staged | None], reuse: bool) -> None:
    for buffer in staged:
        if buffer is not None:
            buffer.release(reuse=reuse)


class StoreOp(BatchOp):
    method = "put_many"
    kind = L2Op.STORE

    def __init__(
        self,
        state: AdapterState,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None,
        limit: Callable[[], Capacity | None],
    ) -> None:
        super().__init__(state, keys)
        self.buffers = [memoryview(buffer).cast("B") for buffer in buffers]
        self.layouts = list(layouts) if layouts is not None else [""] * len(self.keys)
        self.limit = limit
        self.heavy_prepare = not state.chain.identity
        self.payloads: list[memoryview] = []
        self.staged: list[Staged | None] = []
        self.admission = Admission([])
        #: what ``storing_begin`` noted for the keys in the backend call
        self.storing: list[tuple[ObjectKey, int, str, int]] = []
        #: keys this store holds a write claim on (``PinTable.begin_write``), one entry per
        #: claim: from ``prepare`` until ``finish`` has accounted them and told listeners
        self.writing: list[ObjectKey] = []

    def _encode(self, index: int) -> tuple[memoryview, Staged | None] | None:
        state, key = self.state, self.keys[index]
        if state.chain.identity:
            return self.buffers[index], None
        try:
            with plugin_code():  # a serde's SystemExit fails this key too, never the thread
                staged = state.chain.encode(key, self.buffers[index], self.layouts[index])
        except SerdeBoundError as exc:
            state.count("serde_bound_exceeded")
            state.burst.warn("serde_bound", "%s: %s not stored: %s", state.name, key.file_stem(), exc)
            return None
        except Exception as exc:  # a serde refusing one object fails that key only
            state.count("serde_encode_failures")
            state.burst.warn(
                "serde_encode", "%s: serde encode failed for %s: %s", state.name, key.file_stem(), exc
            )
            return None
        return staged.view, staged

    def prepare(self) -> tuple[list[ObjectKey], list[memoryview]]:
        state = self.state
        encoded: list[tuple[int, memoryview, Staged | None]] = []
        for index in range(len(self.keys)):
            outcome = self._encode(index)
            if outcome is not None:
                encoded.append((index, *outcome))
        encoded = self._claim(encoded)
        try:
            try:
                limit = self.limit()
            except Exception as exc:  # no capacity known: nothing can be shown to fit
                state.backend_failed("capacity", exc)
                _release([staged for _, _, staged in encoded], True)
                self._end_write()
                return [], []
            self.admission = state.accounting.admit([(self.keys[i], p.nbytes) for i, p, _ in encoded], limit)
            storing: list[tuple[ObjectKey, int, str, int]] = []
            refused: list[ObjectKey] = []
            for (index, payload, staged), verdict in zip(encoded, self.admission.verdicts, strict=True):
                if verdict is not Verdict.ADMITTED:
                    if staged is not None:
                        staged.release()
                    refused.append(self.keys[index])
                    self._refused(index, verdict)
                    continue
                self.io_index.append(index)
                self.payloads.append(payload)
                self.staged.append(staged)
                storing.append(
                    (self.keys[index], self.buffers[index].nbytes, self.layouts[index], payload.nbytes)
                )
            # Refused keys do not reach the backend: their claims go now, the others' in finish.
            self.writing = self.io_keys()
            state.pins.end_write(refused)
            self.storing = storing
            state.storing_begin(storing)
        except BaseException:  # finish will not run: nothing it would give back may outlive this store
            self._end_write()
            storing, self.storing = self.storing, []
            self.state.storing_end(storing)
            self.state.accounting.settle(self.admission, [])
            held, self.staged = self.staged, []
            _release(held, True)
            raise
        return self.io_keys(), self.payloads

    def _claim(
        self, encoded: list[tuple[int, memoryview, Staged | None]]
    ) -> list[tuple[int, memoryview, Staged | None]]:
        """Claim the encoded keys for writing (``PinTable.begin_write``), under the lock
        that claims keys for deletes: a key a delete is working on is not stored, before
        it is admitted against the capacity; returns the claimed ones."""
        keys = [self.keys[index] for index, _, _ in encoded]
        claimed = self.state.pins.begin_write(keys)
        self.writing = [key for key, ok in zip(keys, claimed, strict=True) if ok]
        kept: list[tuple[int, memoryview, Staged | None]] = []
        for item, ok in zip(encoded, claimed, strict=True):
            if ok:
                kept.append(item)
                continue
            index, _, staged = item
            if staged is not None:
                staged.release()
            self._skipped_deleting(index)
        return kept

    def _end_write(self) -> None:
        """Drop the write claims this store holds (once, whichever path gets here first)."""
        writing, self.writing = self.writing, []
        self.state.pins.end_write(writing)

    def _skipped_deleting(self, index: int) -> None:
        state = self.state
        state.count("store_skipped_deleting")
        state.burst.warn(
            "store_skipped_deleting",
            "%s: %s not stored: a delete of it is in flight, and a store racing it could leave "
            "this adapter's accounting and listeners disagreeing with the store; it fails "
            "like a store refused for capacity",
            state.name,
            self.keys[index].file_stem(),
        )

    def _refused(self, index: int, verdict: Verdict) -> None:
        state = self.state
        if verdict is Verdict.FULL:
            state.count("capacity_refusals")
            reason = "it does not fit under the capacity"
        else:
            state.count("store_refused_scanning")
            reason = "the start-up scan has not finished, so the usage is not known yet"
        state.burst.warn(
            f"store_refused:{verdict.value}",
            "%s: %s not stored: %s",
            state.name,
            self.keys[index].file_stem(),
            reason,
        )

    def finish(self, io_result: Sequence[Any] | None, *, call_returned: bool = True) -> list[bool]:
        state = self.state
        ok = [False] * len(self.keys)
        stored: list[tuple[ObjectKey, ObjectSize]] = []
        try:
            storing, self.storing = self.storing, []  # once, if finish runs twice
            state.storing_end(storing)
            for position, index in enumerate(self.io_index):
                if io_result is not None and io_result[position]:
                    ok[index] = True
                    stored.append(
                        (
                            self.keys[index],
                            ObjectSize(self.payloads[position].nbytes, self.buffers[index].nbytes),
                        )
                    )
            _release(self.staged, call_returned)
            state.accounting.settle(self.admission, stored)
            keys = [key for key, _ in stored]
            state.count("store_keys_ok", len(keys))
            state.count("store_keys_failed", len(self.keys) - len(keys))
            state.notify("on_l2_keys_stored", keys)
            log.debug("%s: stored %d/%d keys", state.name, len(keys), len(self.keys))
        finally:
            # Only now may a delete claim these keys: what it forgets and announces comes
            # after this store's accounting and announcement, never before.  Once, on
            # every path: failed or abandoned calls (``io_result`` None) end here too.
            self._end_write()
        return ok


def resolve_size(
    state: AdapterState,
    key: ObjectKey,
    reported: Found,
    known: ObjectSize | None,
    limit: Callable[[], Capacity | None],
) -> tuple[ObjectSize | None, bool]:
    """Both sizes of a key the backend reported found (None = miss), and whether this call
    accounted it (adopted it: not accounted before).  ``limit``: the backend's capacity,
    asked only for a size accounted (:func:`_note_past_capacity`).

    Whichever way the size is learnt -- an ``ObjectSize`` the backend reports, a plain
    stored size matching the known entry or taken as the L1 size under a chain that
    changes no sizes, or the entry a store or the scan made meanwhile -- the answer
    passes ``_possible_l1_size``: an object larger than L1 is a miss on every path."""
    size = _size_from_report(state, key, reported, known)
    if size is None:
        return None, False
    if known != size and not _possible_size(state, key, size):
        return None, False
    if known is None:
        answer, adopted = _adopted_size(state, key, size)
        if adopted:
            _note_past_capacity(state, key, size, limit)
        return answer, adopted
    if known != size:
        # Accounted already (and known to the eviction policy): the usage follows the
        # object now in the store even when it is too large to load here, or the
        # adapter would overrun its capacity by the difference.
        if state.accounting.record_if(key, known, size):
            _note_past_capacity(state, key, size, limit)
        else:
            # A store replaced the entry while the backend was asked, maybe after the
            # record reported was read: its entry is the newer word on the object (as
            # ``_adopted_size`` takes one), and overwritten the usage would lose it.
            current = state.accounting.get(key)
            if current is not None and current.l1 != UNKNOWN_L1:
                size = current
    return (size if _possible_l1_size(state, key, size) else None), False


def _size_from_report(
    state: AdapterState, key: ObjectKey, reported: Found, known: ObjectSize | None
) -> ObjectSize | None:
    """The sizes the backend's answer gives, before any check; None = miss."""
    if reported is None:
        return None
    if isinstance(reported, ObjectSize):
        return reported
    if known is not None and known.l1 != UNKNOWN_L1 and known.stored == reported:
        return known
    if state.chain.identity:
        return ObjectSize(reported, reported)
    # A size-changing serde and a backend that only knows the stored size: the L1
    # size cannot be derived, so the key is a miss rather than a wrong reservation.
    state.count("lookup_size_unknown")
    state.burst.warn(
        "lookup_size_unknown",
        "%s: %s found but its L1 size is unknown (the serde chain changes sizes, the "
        "backend reported only the stored size, and it is not the size accounted here: "
        "first seen, or stored again since, by another server perhaps); treated as a miss",
        state.name,
        key.file_stem(),
    )
    return None


def _adopted_size(state: AdapterState, key: ObjectKey, size: ObjectSize) -> tuple[ObjectSize | None, bool]:
    """Account ``key`` (not accounted when the lookup began) at ``size``, and whether this
    call did; if a store or the scan accounted it meanwhile, that entry is the newer word
    on the object -- and not adopted here: the store announced it, the scan announces
    its own (``on_l2_keys_scanned``), and a second announcement would read to the policy
    as a second use of the key.

    The size is checked first: a lookup adopts (and tells listeners of) only the keys it
    answers found, so nothing it accounts is hidden from eviction."""
    if not _possible_l1_size(state, key, size):
        return None, False
    if state.accounting.record_if_absent(key, size):
        return size, True
    current = state.accounting.get(key)
    if current is None or current.l1 == UNKNOWN_L1 or current == size:
        return size, False
    return (current if _possible_l1_size(state, key, current) else None), False


def _possible_size(state: AdapterState, key: ObjectKey, size: ObjectSize) -> bool:
    """False (counted as ``lookup_size_impossible``, logged: a miss, the accounting left as
    it was) for a reported size no object can have -- past ``MAX_OBJECT_BYTES``.  A bad
    answer, not the object: accounted, the usage would become absurd and every store be
    refused for capacity.

    A size past the backend's whole capacity is possible: a run with a larger capacity, or
    a server sharing the store, wrote it, and it is in the store all the same.  It is
    accounted as the start-up scan accounts one (:func:`_note_past_capacity`), so the usage
    says what is stored and eviction hears of it; refused, its bytes would stay in the
    store uncounted whenever the scan could not list it."""
    if not impossible_size(size, None):
        return True
    state.count("lookup_size_impossible")
    state.burst.warn(
        "lookup_size_impossible",
        "%s: %s found with an impossible size of %d bytes stored, %d in L1 (past any "
        "object's); treated as a miss, not accounted",
        state.name,
        key.file_stem(),
        size.stored,
        size.l1,
    )
    return False


def _note_past_capacity(
    state: AdapterState, key: ObjectKey, size: ObjectSize, limit: Callable[[], Capacity | None]
) -> None:
    """Count (``lookup_objects_past_capacity``) and log an object a lookup has just
    accounted at ``size`` when that is larger than the backend's whole capacity.  Only
    once accounted: one refused after all (larger than L1 too) is no such object, and
    would be counted again by every lookup of it."""
    capacity = limit()
    if not impossible_size(size, capacity):
        return
    state.count("lookup_objects_past_capacity")
    state.burst.warn(
        "lookup_objects_past_capacity",
        "%s: %s found with %d bytes stored, larger than the capacity of %d bytes (stored "
        "by a run with a larger max_capacity_gb?); accounted and left to eviction",
        state.name,
        key.file_stem(),
        size.stored,
        capacity.bytes if capacity is not None and capacity.bytes is not None else 0,
    )


def _possible_l1_size(state: AdapterState, key: ObjectKey, reported: ObjectSize) -> bool:
    """False (counted as ``record_l1_size_past_capacity``, logged: a miss) for a reported
    L1 size larger than L1 itself.

    Reserved for a prefetch, it would evict all of L1 for an object that can never fit.
    The object is kept: a server with a larger L1 sharing the store may have written it
    (a record header's size comes here too; ``BackendContext.read_record_header`` refuses
    only sizes no server's object can have, counted as ``record_l1_size_impossible``).
    Counted apart from that damage: an operator alerting on damage must not be paged for
    a larger server's valid objects."""
    capacity = state.facts.l1_capacity
    if capacity is None or reported.l1 == UNKNOWN_L1 or reported.l1 <= capacity:
        return True
    state.count("record_l1_size_past_capacity")
    state.burst.warn(
        "record_l1_size_past_capacity",
        "%s: %s found with an L1 size of %d bytes, more than L1's %d; treated as a miss "
        "(kept in the store: a server with a larger L1 may have written it)",
        state.name,
        key.file_stem(),
        reported.l1,
        capacity,
    )
    return False


def _report_gone(
    state: AdapterState, keys: Sequence[ObjectKey], counter: str, event: str, message: str, *args: object
) -> None:
    """Count ``keys`` under ``counter``, log ``message`` (after the adapter's name and the
    count) once per burst, and tell listeners through ``event``."""
    if not keys:
        return
    state.count(counter, len(keys))
    state.burst.warn(counter, "%s: %d " + message, state.name, len(keys), *args, count=len(keys))
    state.notify(event, keys)


def vanished(state: AdapterState, keys: Sequence[ObjectKey], how: str) -> None:
    """Accounted objects the backend reported gone, their bytes released already: counted,
    logged once per burst, and announced as deleted -- an eviction policy would otherwise
    offer them for good, and no delete of this adapter will ever remove them from it."""
    _report_gone(
        state,
        keys,
        "objects_vanished",
        "on_l2_keys_deleted",
        "accounted objects were gone from the store (%s): removed behind this adapter's "
        "back, e.g. by another server sharing the store, the store's own eviction or expiry, "
        "or an operator; their bytes are released",
        how,
    )


def not_accounted(state: AdapterState, keys: Sequence[ObjectKey]) -> None:
    """Keys a delete did not remove, never accounted here, and absent from the store:
    counted, logged once per burst, and announced through ``on_l2_keys_absent`` -- an
    eviction policy seeded from the listing would otherwise offer them for good."""
    _report_gone(
        state,
        keys,
        "delete_keys_absent",
        "on_l2_keys_absent",
        "keys to delete (%s first) were neither in the store nor accounted here: never "
        "stored through this adapter, or listed earlier (e.g. stored by another server "
        "sharing the store after this adapter's start-up scan) and removed since; "
        "listeners are told they are absent",
        keys[0].file_stem() if keys else "",
    )


def forget_gone(
    state: AdapterState, candidates: Sequence[tuple[ObjectKey, ObjectSize]], how: str
) -> list[ObjectKey]:
    """Release accounted keys the backend answered absent; returns the keys released.

    Each comes with the entry read *before* the backend was asked: a store (or lookup)
    that replaced it since may postdate the answer, and is kept.  A key whose record
    turned out to be of another serde chain is reported absent but is there: kept too.
    """
    if not candidates:
        return []
    unreadable = state.unreadable([key for key, _ in candidates])
    gone = [
        key
        for (key, known), kept in zip(candidates, unreadable, strict=True)
        if not kept and state.accounting.forget_if(key, known)
    ]
    vanished(state, gone, how)
    return gone


class LookupOp(BatchOp):
    method = "contains_many"
    kind = L2Op.LOOKUP

    def __init__(
        self, state: AdapterState, keys: Sequence[ObjectKey], capacity: Callable[[], Capacity | None]
    ) -> None:
        super().__init__(state, keys)
        self.capacity = capacity
        self._limit: list[Capacity | None] = []  # the capacity once asked, for this answer
        self.known: list[ObjectSize | None] = []
        self.hits: list[ObjectKey] = []
        #: keys noted by ``reading_begin``, until ``finish``
        self.reading: list[ObjectKey] = []
        #: begun while the start-up scan ran (``begin_scan_lookup``), until ``finish``
        self.during_scan = False

    def prepare(self) -> tuple[list[ObjectKey]]:
        state = self.state
        pinned = state.pins.pin(self.keys)
        unreadable = state.unreadable(self.keys)
        # Records of another serde chain are misses without asking the backend again.
        state.pins.unpin(
            [key for key, ok, bad in zip(self.keys, pinned, unreadable, strict=True) if ok and bad]
        )
        self.io_index = [
            i for i, (ok, bad) in enumerate(zip(pinned, unreadable, strict=True)) if ok and not bad
        ]
        io_keys = self.io_keys()
        # Snapshot the accounting: a miss only forgets an entry no store replaced since.
        self.known = state.accounting.get_many(io_keys)
        state.reading_begin(io_keys)  # a record judged unreadable is not marked if replaced
        self.reading = io_keys
        # Before the backend is asked: a scan ending while it answers must still let the
        # answer release what the scan accounted meanwhile (note_absent).
        self.during_scan = bool(io_keys) and state.accounting.begin_scan_lookup()
        return (io_keys,)

    def abandon(self) -> None:
        """Give back what ``prepare`` took, for a lookup whose answer is not settled here."""
        self.state.pins.unpin(self.reading)
        self.state.reading_end(self.reading)
        self.reading = []
        self._end_scan_lookup()

    def _end_scan_lookup(self) -> None:
        during_scan, self.during_scan = self.during_scan, False  # once
        if during_scan:
            self.state.accounting.end_scan_lookup()

    def finish(self, io_result: Sequence[Any] | None, *, call_returned: bool = True) -> LookupResult:
        try:
            return self._settle(io_result)
        finally:
            self._end_scan_lookup()

    def _settle(self, io_result: Sequence[Any] | None) -> LookupResult:
        state = self.state
        reading, self.reading = self.reading, []  # once, if finish runs twice
        state.reading_end(reading)
        found = [False] * len(self.keys)
        sizes = [0] * len(self.keys)
        misses: list[ObjectKey] = []
        absent: list[tuple[ObjectKey, ObjectSize]] = []  # accounted, and answered absent
        unknown: list[ObjectKey] = []  # not accounted, and answered absent
        adopted: list[ObjectKey] = []  # found, and accounted by this lookup
        for position, index in enumerate(self.io_index):
            key = self.keys[index]
            reported = io_result[position] if io_result is not None else None
            known = self.known[position]
            size, adopted_here = resolve_size(state, key, reported, known, self._capacity_once)
            if size is None:
                misses.append(key)
                if io_result is not None and reported is None:
                    if known is not None:
                        absent.append((key, known))
                    else:
                        unknown.append(key)
                continue
            found[index] = True
            sizes[index] = size.l1
            self.hits.append(key)
            if adopted_here:
                adopted.append(key)
        forget_gone(state, absent, "found by a lookup")
        if unknown and self.during_scan:  # what a listing read earlier may bring back
            self._absent_while_scanning(unknown)
        if adopted:
            # Stored by someone else (another server sharing the store, an earlier process
            # the scan has not reached yet) and accounted from now on: listeners hear of
            # them as stored, so the eviction policy can evict the bytes they add to the
            # usage.  Without this, their bytes would count and never be evictable here.
            state.count("lookup_adopted", len(adopted))
            state.notify("on_l2_keys_stored", adopted)
        state.pins.unpin(misses)
        state.count("lookup_hits", len(self.hits))
        state.count("lookup_misses", len(self.keys) - len(self.hits))
        log.debug("%s: lookup found %d/%d keys", state.name, len(self.hits), len(self.keys))
        return LookupResult(found, sizes)

    def _capacity_once(self) -> Capacity | None:
        """The backend's capacity, asked at most once per answer (it may cost a call)."""
        if not self._limit:
            self._limit.append(self.capacity())
        return self._limit[0]

    def released(self) -> None:
        self.state.pins.unpin(self.hits)

    def _absent_while_scanning(self, unknown: list[ObjectKey]) -> None:
        """Keys not accounted when asked and answered absent: the scan leaves them alone,
        and any it accounted meanwhile are released as vanished.  A record of another
        serde chain is answered absent but is there: the scan's to account."""
        state = self.state
        absent = [key for key, kept in zip(unknown, state.unreadable(unknown), strict=True) if not kept]
        vanished(state, state.accounting.note_absent(absent), "found by a lookup, listed by the scan")


class LoadOp(BatchOp):
    method = "get_many_into"
    kind = L2Op.LOAD

    def __init__(self, state: AdapterState, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> None:
        super().__init__(state, keys)
        self.buffers = [memoryview(buffer).cast("B") for buffer in buffers]
        self.heavy_finish = not state.chain.identity
        self.targets: list[memoryview] = []
        self.staged: list[Staged | None] = []
        self.pinned: list[ObjectKey] = []
        #: keys noted by ``reading_begin``, until ``finish``
        self.reading: list[ObjectKey] = []
        #: layouts read from each key's records while this load was in its backend call
        #: (``AdapterState.note_layout``), until ``finish``
        self.noted: dict[ObjectKey, set[str]] = {}
        #: whether the keys are registered for noting (``loading_begin``), until ``finish``
        self.noting = False

    def prepare(self) -> tuple[list[ObjectKey], list[memoryview]]:
        state = self.state
        identity = state.chain.identity
        # The load's own pin keeps a concurrent delete off the bytes while they are copied,
        # even for a caller that loads without a lookup.
        pinned = state.pins.pin(self.keys)
        unreadable = state.unreadable(self.keys)
        self.pinned = [key for key, ok in zip(self.keys, pinned, strict=True) if ok]
        known = iter(state.accounting.get_many(self.pinned))
        for index, ok in enumerate(pinned):
            if not ok:
                self._skip(index, "load_skipped_deleting", "a delete of it is in flight")
                continue
            size = next(known)
            buffer = self.buffers[index]
            if unreadable[index]:
                self._skip(
                    index,
                    "load_skipped_unreadable",
                    "its record was written with another serde chain or in a newer format, "
                    "or the configured chain failed to decode it (a miss until it is replaced)",
                )
                continue
            if size is not None and size.l1 != UNKNOWN_L1 and size.l1 != buffer.nbytes:
                self._skip(
                    index,
                    "load_size_mismatch",
                    f"the load buffer holds {buffer.nbytes} bytes, the object needs {size.l1}",
                )
                continue
            if identity:
                target, staged = buffer, None
            elif size is None:
                self._skip(
                    index,
                    "load_size_unknown",
                    "the serde chain decodes it from a staging buffer, and its encoded size is "
                    "not known here (no lookup found it)",
                )
                continue
            else:
                staged = self._staging(index, size.stored)
                if staged is None:
                    continue
                target = staged.view
            self.io_index.append(index)
            self.targets.append(target)
            self.staged.append(staged)
        io_keys = self.io_keys()
        state.loading_begin(io_keys, self.noted)  # the records' layouts, as they are read
        self.noting = True
        state.reading_begin(io_keys)  # a record judged unreadable is not marked if replaced
        self.reading = io_keys
        return io_keys, self.targets

    def _skip(self, index: int, counter: str, reason: str) -> None:
        """A key failed before the backend call: counted under ``counter``, and ``reason``
        logged once per burst of its kind."""
        state = self.state
        state.count(counter)
        state.burst.warn(counter, "%s: %s not loaded: %s", state.name, self.keys[index].file_stem(), reason)

    def _staging(self, index: int, size: int) -> Staged | None:
        """A staging buffer for the encoded object, or None (counted, logged) when no memory
        can be mapped for it: that key fails, not the batch -- raising here would leave
        the batch's pins held and, on an event loop, its task never completed."""
        state = self.state
        try:
            return state.chain.pool.take(size)
        except (OSError, MemoryError, OverflowError) as exc:
            state.count("load_staging_failures")
            state.burst.warn(
                "load_staging",
                "%s: %s not loaded: no staging buffer of %d bytes: %s",
                state.name,
                self.keys[index].file_stem(),
                size,
                exc,
            )
            return None

    def finish(self, io_result: Sequence[Any] | None, *, call_returned: bool = True) -> LoadResult:
        state = self.state
        ok = [False] * len(self.keys)
        layouts = [""] * len(self.keys)
        loaded: list[ObjectKey] = []
        try:
            # First: what is read of the keys' records from now on (a lookup, another
            # load) is not what this load copied.
            self._end_noting()
            for position, index in enumerate(self.io_index):
                if io_result is None or not io_result[position]:
                    continue
                layout = self._layout(index)
                if layout is None:
                    continue
                if not state.chain.identity and not self._decode(position, index, layout):
                    continue
                ok[index] = True
                layouts[index] = layout
                loaded.append(self.keys[index])
        finally:
            _release(self.staged, call_returned)
            state.pins.unpin(self.pinned)
            self._end_noting()
            reading, self.reading = self.reading, []  # once, if finish runs twice
            state.reading_end(reading)
        state.count("load_keys_ok", len(loaded))
        state.count("load_keys_failed", len(self.keys) - len(loaded))
        state.notify("on_l2_keys_loaded", loaded)
        log.debug("%s: loaded %d/%d keys", state.name, len(loaded), len(self.keys))
        return LoadResult(ok, layouts)

    def _end_noting(self) -> None:
        if self.noting:
            self.noting = False
            self.state.loading_end(self.io_keys(), self.noted)

    def _layout(self, index: int) -> str | None:
        """The layout the record this load copied of ``keys[index]`` states ("" when none
        was read), or None when two were read while the load ran: an overlapping read of
        a record another store replaced meanwhile, so which one the bytes are of is
        unknown -- a miss (counted, logged), never bytes labelled with another's layout."""
        state, key = self.state, self.keys[index]
        noted = self.noted.get(key)
        if not noted:
            return ""
        if len(noted) == 1:
            return next(iter(noted))
        state.count("load_layout_ambiguous")
        state.burst.warn(
            "load_layout_ambiguous",
            "%s: %s not loaded: records of it stating different layouts (%s) were read while it "
            "loaded (a store replaced it meanwhile), and which one its bytes are of is unknown",
            state.name,
            key.file_stem(),
            ", ".join(sorted(repr(layout) for layout in noted)),
        )
        return None

    def _decode(self, position: int, index: int, layout: str) -> bool:
        state, key = self.state, self.keys[index]
        try:
            with plugin_code():  # a serde's SystemExit is a miss too, never the thread's end
                state.chain.decode_into(key, self.targets[position], self.buffers[index], layout)
        except Exception as exc:  # tampered or damaged payload: a miss, not garbage
            state.count("serde_decode_failures")
            marked = state.mark_undecodable(key)
            state.burst.warn(
                "serde_decode",
                "%s: serde decode failed for %s: %s (%s)",
                state.name,
                key.file_stem(),
                exc,
                "a miss until it is replaced" if marked else "a store of it replaced that record meanwhile",
            )
            return False
        return True


class DeleteOp(BatchOp):
    """Deletes the keys no reader pinned and no store is writing.  Accounted keys the
    backend did not delete are left in ``unconfirmed``, keys it did not delete that were
    not accounted in ``unaccounted``: absent or not removable, ``delete_many`` cannot
    tell, and the adapter asks the backend about them next (``AbsenceCheckOp``).

    Every key not claimed is counted in ``delete_keys_skipped`` (pinned, being deleted
    already, repeated in the batch, or being stored); those refused because a store of
    them is in flight are also counted in ``delete_skipped_storing`` and logged once per
    burst: they stay stored, and a later delete can remove them.
    """

    method = "delete_many"

    def __init__(self, state: AdapterState, keys: Sequence[ObjectKey]) -> None:
        super().__init__(state, keys)
        self.known: list[ObjectSize | None] = []
        self.unconfirmed: list[tuple[ObjectKey, ObjectSize]] = []
        self.unaccounted: list[ObjectKey] = []
        #: keys this delete claimed, until ``finish`` has forgotten them and told listeners
        self.claimed: list[ObjectKey] = []
        #: keys it did not claim: refused for core's own reasons, not the backend's
        self.refused: frozenset[ObjectKey] = frozenset()

    def prepare(self) -> tuple[list[ObjectKey]]:
        state = self.state
        claims = state.pins.claim_delete(self.keys)
        self.io_index = [i for i, claim in enumerate(claims) if claim is Claim.CLAIMED]
        self.refused = frozenset(
            key for key, claim in zip(self.keys, claims, strict=True) if claim is not Claim.CLAIMED
        )
        io_keys = self.io_keys()
        self.claimed = list(io_keys)
        state.count("delete_keys_skipped", len(self.keys) - len(self.io_index))
        storing = [key for key, claim in zip(self.keys, claims, strict=True) if claim is Claim.STORING]
        if storing:
            state.count("delete_skipped_storing", len(storing))
            state.burst.warn(
                "delete_skipped_storing",
                "%s: %d keys not deleted (%s first): a store of each is in flight, and a "
                "delete racing it could leave the store and this adapter's accounting "
                "disagreeing; they stay stored, a later delete can remove them",
                state.name,
                len(storing),
                storing[0].file_stem(),
                count=len(storing),
            )
        # Snapshot the accounting: a key the backend did not delete is released later only
        # if no store replaced its entry in between.
        self.known = state.accounting.get_many(io_keys)
        return (io_keys,)

    def finish(self, io_result: Sequence[Any] | None, *, call_returned: bool = True) -> list[bool]:
        state = self.state
        ok = [False] * len(self.keys)
        deleted: list[ObjectKey] = []
        try:
            for position, index in enumerate(self.io_index):
                if io_result is None:
                    break  # the call failed: nothing is known about any key
                key = self.keys[index]
                if io_result[position]:
                    ok[index] = True
                    state.accounting.forget(key)
                    deleted.append(key)
                elif (known := self.known[position]) is not None:
                    self.unconfirmed.append((key, known))
                else:
                    self.unaccounted.append(key)
            state.forget_unreadable(deleted)
            state.count("delete_keys_ok", len(deleted))
            state.notify("on_l2_keys_deleted", deleted)
        finally:
            # Only now may a store (or a lookup) claim these keys: its accounting and
            # announcement come after this delete's.  Once, if finish runs twice (a
            # cancelled call on an event loop).
            claimed, self.claimed = self.claimed, []
            state.pins.end_delete(claimed)
        return ok


class AbsenceCheckOp(BatchOp):
    """``contains_many`` for the keys a delete did not remove.  Accounted ones the backend
    answers absent were removed behind this adapter's back (another server sharing the
    store, the store's own eviction or expiry, an operator) and are released, counted and
    announced as deleted.  Those still there stay accounted: their delete failed.

    Unaccounted ones answered absent were never stored through this adapter nor found by
    it, but may have been listed (``iter_keys`` seeds the eviction policy): stored by
    another server after the start-up scan, then removed.  They are counted as
    ``delete_keys_absent`` and announced through ``on_l2_keys_absent`` (a listener that
    hears of deletes only of keys it heard stored would otherwise keep offering them).
    They are claimed as for a delete, so no store or lookup of them overlaps the check:
    a later store's ``on_l2_keys_stored`` comes after this announcement.

    A separate operation, run by the same runner as every call (circuit breaker, call
    timeouts and event loops apply); the keys are claimed as for a delete again, so a key
    a reader pinned since is left alone -- its lookup asks the backend itself.  Stores of
    the keys may run meanwhile (``PinTable.begin_check``): a key is released only if its
    entry is still the one read before the delete (``forget_if``), so one a store
    replaced is kept, and one released before a store settles is recorded again by it.
    """

    method = "contains_many"

    def __init__(
        self,
        state: AdapterState,
        unconfirmed: Sequence[tuple[ObjectKey, ObjectSize]],
        unaccounted: Sequence[ObjectKey] = (),
    ) -> None:
        super().__init__(state, [key for key, _ in unconfirmed] + list(unaccounted))
        self.known: list[ObjectSize | None] = [size for _, size in unconfirmed]
        self.known += [None] * len(unaccounted)
        self.claimed: list[ObjectKey] = []
        #: keys noted by ``reading_begin``, until ``finish``
        self.reading: list[ObjectKey] = []

    def prepare(self) -> tuple[list[ObjectKey]]:
        pins, accounted = self.state.pins, len(self.keys) - self.known.count(None)
        claimed = pins.begin_check(self.keys[:accounted])
        claimed += [claim is Claim.CLAIMED for claim in pins.claim_delete(self.keys[accounted:])]
        self.io_index = [i for i, ok in enumerate(claimed) if ok]
        self.claimed = self.io_keys()
        # A record of another serde chain is answered absent too, and ``forget_gone``
        # keeps keys marked so; marked before, such a key would be kept even when its
        # record is gone (accounted, and an eviction victim, for good).  Unmarked, the
        # backend's answer decides: reading the record marks it again if it is there.
        self.state.forget_unreadable(self.claimed)
        self.state.count("delete_keys_checked", len(self.io_index))
        # Stores of accounted keys may run during the check: a record of another chain it
        # reads may be one they replace, and is then not marked.
        self.state.reading_begin(self.claimed)
        self.reading = list(self.claimed)
        return (self.io_keys(),)

    def finish(self, io_result: Sequence[Any] | None, *, call_returned: bool = True) -> list[ObjectKey]:
        state = self.state
        try:
            absent = [
                (self.keys[index], self.known[index])
                for position, index in enumerate(self.io_index)
                if io_result is not None and io_result[position] is None
            ]
            gone = forget_gone(
                state, [(key, known) for key, known in absent if known is not None], "found after a delete"
            )
            loose = [key for key, known in absent if known is None]
            if loose:
                unreadable = state.unreadable(loose)  # of another serde chain: there
                loose = [key for key, kept in zip(loose, unreadable, strict=True) if not kept]
                # Claimed as for a delete, so no store or lookup accounted one since; the
                # start-up scan may have, from a listing older than this answer: released
                # as any accounted key found gone.  ``forget`` also keeps a scan still
                # running from accounting them later.
                scanned = [state.accounting.forget(key) is not None for key in loose]
                listed = [key for key, was in zip(loose, scanned, strict=True) if was]
                vanished(state, listed, "found after a delete")
                gone += listed
                not_accounted(state, [key for key, was in zip(loose, scanned, strict=True) if not was])
            return gone
        finally:
            claimed, self.claimed = self.claimed, []  # once, if finish runs twice
            state.pins.end_delete(claimed)
            reading, self.reading = self.reading, []
            state.reading_end(reading)
