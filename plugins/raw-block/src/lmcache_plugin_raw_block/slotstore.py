"""What ``raw_block`` and ``dax`` backends share: the backend protocol over a slot table.

A subclass says how one slot's bytes move (``_write_slot``, ``_fetch``, ``_fill``) and
where a slot's header lives (``_slot_place``, ``header_room``); this class does the rest
the same way for both: refusing objects larger than a slot, claiming slots a group at a
time, building each slot header from core's record header, publishing a key only after
its slot was written, verifying every load (slot header, record header, payload
checksum) and removing what fails.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections.abc import Sequence

from lmcache_plugin_raw_block.slotheader import encode_slot_header
from lmcache_plugin_raw_block.slots import CLAIM_GROUP, Claim, SlotEntry, SlotTable
from lmcache_tiers.plugin import (
    BackendContext,
    BatchWorkers,
    BurstLog,
    Capacity,
    ObjectKey,
    ObjectSize,
    RecordCorruptError,
    RecordError,
    RecordHeader,
    RecordVerdict,
    record_verdict,
    verify_payload,
)

__all__ = ["CLAIM_GROUP", "SlotStoreBackend", "as_bytes", "newer_format"]


def as_bytes(buffer: memoryview) -> memoryview:
    return buffer if buffer.format == "B" else buffer.cast("B")


def newer_format(error: RecordError) -> bool:
    """Whether a slot's record failed to read only because a newer server wrote it in a
    format version this code does not read.

    Such a record is intact: a newer server on this device (before a downgrade) wrote it
    and reads it again after an upgrade.  Its slot header, of the format this code reads,
    names its key and sizes, so it stays a published object: listed and accounted like
    any other (L2 eviction and deletes reclaim its slot, a store of its key replaces
    it).  Once found (at start-up, or at its first load) it is counted
    ``record_version_unknown`` and its key is a miss until replaced
    (``BackendContext.unknown_version_indexed``): the index would otherwise find it at
    every lookup and every load would read the whole slot only to fail.  Freeing its slot
    would throw away a write that is not damaged; keeping the slot unlisted would take it
    out of the capacity for good.  Another key's record under a slot header naming this
    key is no other writer's object (the slot header names the key its writer stored):
    damage, removed like any.
    """
    return record_verdict(error) is RecordVerdict.NEWER


class SlotStoreBackend(ABC):
    """The batch methods of a slot store; subclasses move the bytes of one slot."""

    #: one store thread (raw_block's recovery relies on at most CLAIM_GROUP writes in
    #: flight); loads and stores use worker pools of their own within a batch
    concurrency = 1
    type_name: str
    #: what to raise for objects that do not fit, in the refusal's log line
    too_large_hint: str
    context: BackendContext
    table: SlotTable

    def _init_slot_store(
        self, context: BackendContext, payload_limit: int, store_workers: int, load_workers: int
    ) -> None:
        self.context = context
        self.payload_limit = payload_limit
        self._burst = BurstLog()
        self._readers = BatchWorkers(load_workers, f"{self.type_name}-{context.name}-load")
        self._writers = BatchWorkers(store_workers, f"{self.type_name}-{context.name}-store", background=True)

    def _stop_workers(self) -> None:
        self._writers.shutdown(wait=False)
        self._readers.shutdown(wait=False)

    # -- what a subclass provides ----------------------------------------------------------

    @property
    @abstractmethod
    def header_room(self) -> int:
        """Bytes a slot header may take."""

    @abstractmethod
    def _slot_place(self, slot: int) -> tuple[bytes, int]:
        """(identity of the device holding ``slot``, the slot's number on that device)."""

    @abstractmethod
    def _write_slot(self, claim: Claim, header: bytes, payload: memoryview) -> None:
        """Write the payload and header of a claimed slot; OSError when it failed."""

    @abstractmethod
    def _fetch(self, entry: SlotEntry, key: ObjectKey, target: memoryview) -> bytes | None:
        """The record header of ``entry``'s slot if its slot header is that of write
        ``entry.seq`` of ``key`` (None otherwise); may fill ``target`` on the way."""

    @abstractmethod
    def _fill(self, entry: SlotEntry, target: memoryview) -> None:
        """Copy the payload into ``target`` unless :meth:`_fetch` did."""

    def _fill_verified(self, entry: SlotEntry, target: memoryview, record: RecordHeader) -> None:
        """:meth:`_fill`, then raise ``RecordChecksumError`` unless ``target`` matches
        ``record``; slots in memory (``dax``) do both in one pass."""
        self._fill(entry, target)
        verify_payload(record, target)

    def _copy_payload(self, claim: Claim, payload: memoryview) -> bytes | None:
        """Copy ``payload`` into the claimed slot before its header exists and return the
        checksum of the copy, or None when :meth:`_write_slot` writes the payload.  Slots
        in memory (``dax``) checksum the bytes as they copy them, in one pass."""
        return None

    def _still_current(self, entry: SlotEntry) -> bool:
        """Whether the slot still holds ``entry``'s write after the copy."""
        return True

    def _stores_paused(self) -> str | None:
        """Why no slot may be claimed now, or None (``raw_block``: slots quarantined since
        its last checkpoint that a crash recovery would take for the end of the writes)."""
        return None

    def _quarantine_on(self, error: OSError) -> bool:
        """Whether a slot whose write failed so is kept out of use: after a media error
        (EIO) it is; after a full thin-provisioned device (ENOSPC) or anything else it
        is offered again, so stores succeed again once the cause is gone."""
        return error.errno == errno.EIO

    # -- start-up --------------------------------------------------------------------------

    def _keep_newer_records(self, newer: Sequence[tuple[ObjectKey, SlotEntry, RecordError]]) -> int:
        """After recovery restored the table: each record of a newer format (found with its
        entry and error) that is still its key's object is a miss until replaced
        (:func:`newer_format`); one a later write of its key superseded is not.  Returns
        how many."""
        current = self.table.lookup([key for key, _entry, _error in newer])
        kept = 0
        for (key, entry, error), now in zip(newer, current, strict=True):
            if now == entry:
                self.context.unknown_version_indexed(key, error)
                kept += 1
        return kept

    # -- stores ----------------------------------------------------------------------------

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        results = [False] * len(keys)
        fitting = []
        for index, payload in enumerate(payloads):
            if payload.nbytes <= self.payload_limit:
                fitting.append(index)
                continue
            self.context.count("object_too_large")
            self._burst.warn(
                "too_large",
                "%s: %s not stored: %d bytes exceed a slot's %d; %s",
                self.type_name,
                keys[index].file_stem(),
                payload.nbytes,
                self.payload_limit,
                self.too_large_hint,
            )
        for start in range(0, len(fitting), CLAIM_GROUP):
            group = fitting[start : start + CLAIM_GROUP]
            if self.context.closing:
                self._stopped_closing("store", len(fitting) - start)
                break
            paused = self._stores_paused()
            if paused is not None:
                self.context.count("stores_paused", len(group))
                self._burst.warn(
                    "paused", "%s: %d objects not stored: %s", self.type_name, len(group), paused
                )
                continue
            claims = self.table.claim(len(group))
            if len(claims) < len(group):
                self.context.count("no_free_slot", len(group) - len(claims))
                self._burst.warn(
                    "no_slot",
                    "%s: %d objects not stored: no free slot",
                    self.type_name,
                    len(group) - len(claims),
                )
            chosen = group[: len(claims)]
            stored = self._store_group([keys[i] for i in chosen], [payloads[i] for i in chosen], claims)
            for index, ok in zip(chosen, stored, strict=True):
                results[index] = ok
        return results

    def _store_group(
        self, keys: list[ObjectKey], payloads: list[memoryview], claims: list[Claim]
    ) -> list[bool]:
        return self._writers.map(self._store_one, keys, payloads, claims)

    def _store_one(
        self, key: ObjectKey, payload: memoryview, claim: Claim, copied: bytes | BaseException | None = None
    ) -> bool:
        """Write one object into its claimed slot and publish it; False when it failed
        (counted, logged, the claim given back).  ``copied``: what :meth:`_copy_payload`
        returned or raised when the caller ran it already (``dax`` copies a whole group
        before writing any header)."""
        quarantine = False
        if self.context.closing:
            # Core hands a store's buffers back once closing began, and the final
            # checkpoint may be written already: nothing more is written or published.
            self._stopped_closing("store", 1)
            self.table.abandon(claim)
            return False
        try:
            data = as_bytes(payload)
            if isinstance(copied, BaseException):
                raise copied
            digest = self._copy_payload(claim, data) if copied is None else copied
            record = self.context.record_header(key, data, digest=digest)
            l1 = self.context.l1_size_of(key) or data.nbytes
            identity, local = self._slot_place(claim.slot)
            header = encode_slot_header(identity, local, claim.seq, key, data.nbytes, l1, record)
            if len(header) > self.header_room:
                raise ValueError(
                    f"its slot header needs {len(header)} bytes, a slot has room for {self.header_room}"
                )
            self._write_slot(claim, header, data)
            self.table.publish(key, SlotEntry(claim.slot, claim.seq, data.nbytes, l1))
            return True
        except ValueError as exc:  # a header that cannot be encoded or does not fit
            self.context.count("header_too_large")
            self._burst.warn("header", "%s: %s not stored: %s", self.type_name, key.file_stem(), exc)
        except OSError as exc:
            quarantine = self._quarantine_on(exc)
            self.context.count("slot_write_errors")
            self._burst.warn("write", "%s: writing slot %d failed: %s", self.type_name, claim.slot, exc)
        except BaseException:
            self.table.abandon(claim)
            raise
        self.table.abandon(claim, quarantine=quarantine)
        return False

    # -- lookups and loads -----------------------------------------------------------------

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[ObjectSize | None]:
        return _sizes(self.table.lookup(keys))

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> list[ObjectSize | None] | None:
        """The slot table is in memory: answered on the caller's thread unless a worker
        holds its lock right now."""
        entries = self.table.lookup_now(keys)
        return None if entries is None else _sizes(entries)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        entries = self.table.acquire(keys)
        try:
            results = [False] * len(keys)
            wanted = []
            for index, entry in enumerate(entries):
                if entry is None:
                    continue
                if entry.stored != buffers[index].nbytes:
                    self._size_changed(keys[index], entry.stored, buffers[index].nbytes)
                    continue
                wanted.append(index)
            outcomes = self._load_group(
                [keys[i] for i in wanted], [entries[i] for i in wanted], [buffers[i] for i in wanted]
            )
            for index, outcome in zip(wanted, outcomes, strict=True):
                if not isinstance(outcome, RecordError):
                    results[index] = outcome
                elif self.context.closing:
                    pass  # core may have given the buffer to another object: it proves nothing
                elif newer_format(outcome):
                    self.context.unknown_version_indexed(keys[index], outcome)
                else:
                    self._remove_damaged(keys[index], entries[index], outcome)
            return results
        finally:
            self.table.release(entries)

    def _load_group(
        self, keys: list[ObjectKey], entries: list[SlotEntry | None], buffers: list[memoryview]
    ) -> list[bool | RecordError]:
        return self._readers.map(self._load_one, keys, entries, buffers)

    def _load_one(self, key: ObjectKey, entry: SlotEntry, buffer: memoryview) -> bool | RecordError:
        if self.context.closing:
            # Core fails a load still running at its close deadline and gives its buffers
            # to other objects: nothing more is read into them.
            self._stopped_closing("load", 1)
            return False
        target = as_bytes(buffer)
        try:
            record_bytes = self._fetch(entry, key, target)
            if record_bytes is None:
                raise RecordCorruptError(
                    f"the header of slot {entry.slot} is damaged or not that of write "
                    f"{entry.seq} of {key.file_stem()}"
                )
            record = self.context.read_record_header(record_bytes, key)
            if record is None:
                return False  # written with another serde chain: kept, a miss
            if record.payload_len != target.nbytes:
                raise RecordCorruptError(
                    f"the record says {record.payload_len} bytes, the index {target.nbytes}"
                )
            self._fill_verified(entry, target, record)
        except OSError as exc:
            if self.context.closing:
                # The close released the device between the check above and the read:
                # the close stopped this load, the device did not fail it.
                self._stopped_closing("load", 1)
                return False
            self.context.count("slot_read_errors")
            self._burst.warn("read", "%s: reading slot %d failed: %s", self.type_name, entry.slot, exc)
            return False
        except RecordError as exc:
            # Without its traceback: its frames reference buffers (a mapping's) that must
            # not outlive this call, and the error is kept and logged.
            return exc.with_traceback(None)
        return self._still_current(entry)

    def _size_changed(self, key: ObjectKey, stored: int, wanted: int) -> None:
        """The key's object is not the size the load's buffer was made for (replaced since
        the lookup by one of another size): a miss, nothing read, the object kept."""
        self.context.count("load_size_changed")
        self._burst.warn(
            "size_changed",
            "%s: %s not loaded: it is %d bytes in its slot, the load buffer %d (replaced since "
            "the lookup); a miss, the object kept",
            self.type_name,
            key.file_stem(),
            stored,
            wanted,
        )

    def _stopped_closing(self, what: str, count: int) -> None:
        """Count and explain objects of a store or load not moved: the adapter is closing."""
        self.context.count(f"{what}_stopped_closing", count)
        self._burst.warn(
            f"{what}_closing",
            "%s: %d objects of a %s not moved: the adapter is closing",
            self.type_name,
            count,
            what,
        )

    def _remove_damaged(self, key: ObjectKey, entry: SlotEntry | None, error: RecordError) -> None:
        assert entry is not None
        accounted = self.context.accounted_size(key)  # before: a store settling since keeps its own
        if self.table.discard(key, entry):
            self.context.record_removed(key, accounted)
            self.context.count("corrupt_records_removed")
            self._burst.warn(
                "corrupt",
                "%s: %s in slot %d removed: %s",
                self.type_name,
                key.file_stem(),
                entry.slot,
                str(error),
            )

    # -- the rest of the backend protocol --------------------------------------------------

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self.table.delete(keys)

    def list_keys(self) -> list[tuple[ObjectKey, ObjectSize]]:
        return [(key, ObjectSize(entry.stored, entry.l1)) for key, entry in self.table.items()]

    def capacity(self) -> Capacity:
        # Quarantined slots hold nothing until the next start: counted here, usage would
        # stay below the eviction watermark once every other slot is taken, and new
        # objects would be refused (no_free_slot) until a restart.
        return Capacity(objects=self.table.slot_count - self.table.quarantined_slots)


def _sizes(entries: Sequence[SlotEntry | None]) -> list[ObjectSize | None]:
    """A lookup's answer: the stored and L1 size of each entry found."""
    return [None if entry is None else ObjectSize(entry.stored, entry.l1) for entry in entries]
