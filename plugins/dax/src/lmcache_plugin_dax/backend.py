"""``dax``: objects in fixed-size slots of memory-mapped DAX devices or files.

Core does pins, accounting, capacity admission, serde and the adapter threads; this
backend maps keys to slots (``lmcache_plugin_raw_block.slots``) spread over one or
several mappings (``mapping.py``).  A store claims a free slot, copies the payload into
it, writes the slot's index entry and commits it with one 8-byte store of the write's
sequence number; only then is the key published.  A load copies the slot out and hands
the bytes back only if the entry names the key and write it expects, the record header
verifies, the copy matches the payload checksum and the commit word still holds the same
write (the slot's generation) after the copy.  Deleting clears the commit word, so a
restart brings back exactly the committed objects; a slot being read is reused only once
its readers are done.  Copies release the GIL (``copy_into``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from lmcache_plugin_raw_block.guards import InFlight
from lmcache_plugin_raw_block.parallel import Workers
from lmcache_plugin_raw_block.slotheader import decode_slot_header, encode_slot_header, record_of
from lmcache_plugin_raw_block.slots import Claim, SlotEntry, SlotTable

from lmcache_plugin_dax.config import DaxConfig
from lmcache_plugin_dax.layout import COMMIT_BYTES, ENTRY_BYTES
from lmcache_plugin_dax.mapping import DaxRegion
from lmcache_tiers.plugin import (
    BackendContext,
    BurstLog,
    Capacity,
    ObjectKey,
    ObjectSize,
    RecordCorruptError,
    RecordError,
    copy_into,
    verify_payload,
)

log = logging.getLogger(__name__)

#: slots claimed and written per round of a store batch
CLAIM_GROUP = 64
#: how long close() waits for copies that outlived the adapter's own wait
CLOSE_DRAIN_S = 10.0


def _interleave(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(region, local slot) of every global slot, the regions taken in turn, so that
    lowest-first allocation spreads objects (and bandwidth) over all mappings."""
    regions = np.concatenate([np.full(count, index, dtype=np.int64) for index, count in enumerate(counts)])
    locals_ = np.concatenate([np.arange(count, dtype=np.int64) for count in counts])
    order = np.lexsort((regions, locals_))
    return regions[order], locals_[order]


class DaxBackend:
    """Backend over the slots of one or several mappings; see the module docstring."""

    concurrency = 1

    def __init__(self, config: DaxConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self._burst = BurstLog()
        self._in_flight = InFlight()
        self.regions: list[DaxRegion] = []
        try:
            for device in config.mappings():
                self.regions.append(DaxRegion(device.device_path, device.max_dax_size_gb, config.slot_bytes))
            counts = [region.layout.slot_count for region in self.regions]
            self._region_of, self._local_of = _interleave(counts)
            self._global_of = []
            for index, count in enumerate(counts):
                mask = self._region_of == index
                global_of = np.empty(count, dtype=np.int64)
                global_of[self._local_of[mask]] = np.flatnonzero(mask)
                self._global_of.append(global_of)
            self.table = SlotTable(sum(counts), on_free=self._clear)
            reopened = [region.mount(keep=config.persist_enabled) for region in self.regions]
            self._recover([r for r, kept in zip(self.regions, reopened, strict=True) if kept])
        except BaseException:
            for region in self.regions:
                region.close()
            raise
        self._readers = Workers(config.load_workers, "dax-load")
        self._writers = Workers(config.num_store_workers, "dax-store")

    def _place(self, slot: int) -> tuple[DaxRegion, int]:
        return self.regions[int(self._region_of[slot])], int(self._local_of[slot])

    def _clear(self, slot: int) -> None:
        """A slot became free: uncommit it, so a restart does not bring its object back."""
        region, local = self._place(slot)
        with self._in_flight.use() as usable:
            if usable:
                region.clear(local)

    # -- start-up --------------------------------------------------------------------------

    def _recover(self, regions: Sequence[DaxRegion]) -> None:
        entries: list[tuple[ObjectKey, SlotEntry]] = []
        dropped = corrupt = 0
        for region in regions:
            index = self.regions.index(region)
            for local, seq in region.committed():
                header = decode_slot_header(region.entry_header(local), region.identity, local)
                if header is None or header.seq != seq or header.stored > self.config.slot_bytes:
                    region.clear(local)
                    dropped += 1
                    continue
                try:
                    self.context.read_record_header(header.record, header.key)
                except RecordError as exc:
                    region.clear(local)
                    corrupt += 1
                    log.warning(
                        "dax: %s slot %d (%s) dropped: %s", region.path, local, header.key.file_stem(), exc
                    )
                    continue
                slot = int(self._global_of[index][local])
                entries.append((header.key, SlotEntry(slot, seq, header.stored, header.l1)))
        superseded = self.table.restore(entries, next_seq=1)
        for entry in superseded:
            self._clear(entry.slot)
        self.context.count("recovered_objects", len(entries) - len(superseded))
        self.context.count("recovery_dropped_slots", dropped + len(superseded))
        self.context.count("corrupt_records_removed", corrupt)
        if regions:
            log.info(
                "dax: %d objects recovered from %d mappings, %d index entries dropped",
                len(entries) - len(superseded),
                len(regions),
                dropped + corrupt + len(superseded),
            )

    # -- stores ----------------------------------------------------------------------------

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        results = [False] * len(keys)
        fitting = []
        for index, payload in enumerate(payloads):
            if payload.nbytes <= self.config.slot_bytes:
                fitting.append(index)
                continue
            self.context.count("object_too_large")
            self._burst.warn(
                "too_large",
                "dax: %s not stored: %d bytes exceed slot_bytes %d",
                keys[index].file_stem(),
                payload.nbytes,
                self.config.slot_bytes,
            )
        for start in range(0, len(fitting), CLAIM_GROUP):
            group = fitting[start : start + CLAIM_GROUP]
            claims = self.table.claim(len(group))
            if len(claims) < len(group):
                self.context.count("no_free_slot", len(group) - len(claims))
                self._burst.warn(
                    "no_slot", "dax: %d objects not stored: no free slot", len(group) - len(claims)
                )
            chosen = group[: len(claims)]
            with self._in_flight.use() as usable:
                if not usable:
                    for claim in claims:
                        self.table.abandon(claim)
                    return results
                stored = self._writers.map(
                    self._store_one, [keys[i] for i in chosen], [payloads[i] for i in chosen], claims
                )
            for index, ok in zip(chosen, stored, strict=True):
                results[index] = ok
        return results

    def _store_one(self, key: ObjectKey, payload: memoryview, claim: Claim) -> bool:
        region, local = self._place(claim.slot)
        try:
            data = payload if payload.format == "B" else payload.cast("B")
            # The checksum reads the payload first, so the copy finds it in cache.
            record = self.context.record_header(key, data)
            l1 = self.context.l1_size_of(key) or data.nbytes
            header = encode_slot_header(region.identity, local, claim.seq, key, data.nbytes, l1, record)
            if len(header) > ENTRY_BYTES - COMMIT_BYTES:
                raise ValueError(
                    f"its index entry needs {len(header)} bytes, an entry holds {ENTRY_BYTES - COMMIT_BYTES}"
                )
            copy_into(region.slot(local, data.nbytes), data)
            region.write_entry(local, header, claim.seq)
        except ValueError as exc:
            self.context.count("header_too_large")
            self._burst.warn("header", "dax: %s not stored: %s", key.file_stem(), exc)
            self.table.abandon(claim)
            return False
        except BaseException:
            self.table.abandon(claim)
            raise
        self.table.publish(key, SlotEntry(claim.slot, claim.seq, data.nbytes, l1))
        return True

    # -- lookups and loads -----------------------------------------------------------------

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[ObjectSize | None]:
        return [
            None if entry is None else ObjectSize(entry.stored, entry.l1) for entry in self.table.lookup(keys)
        ]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        entries = self.table.acquire(keys)
        try:
            results = [False] * len(keys)
            wanted = [
                i
                for i, entry in enumerate(entries)
                if entry is not None and entry.stored == buffers[i].nbytes
            ]
            with self._in_flight.use() as usable:
                if not usable:
                    return results
                outcomes = self._readers.map(
                    self._load_one,
                    [keys[i] for i in wanted],
                    [entries[i] for i in wanted],
                    [buffers[i] for i in wanted],
                )
            for index, outcome in zip(wanted, outcomes, strict=True):
                if isinstance(outcome, RecordError):
                    self._remove_damaged(keys[index], entries[index], outcome)
                else:
                    results[index] = outcome
            return results
        finally:
            self.table.release(entries)

    def _load_one(self, key: ObjectKey, entry: SlotEntry | None, buffer: memoryview) -> bool | RecordError:
        assert entry is not None
        region, local = self._place(entry.slot)
        target = buffer if buffer.format == "B" else buffer.cast("B")
        record_bytes = record_of(region.entry_header(local), region.identity, local, entry.seq, key)
        if record_bytes is None:
            return RecordCorruptError(
                f"the index entry of slot {local} of {region.path} is damaged or not that of "
                f"write {entry.seq} of {key.file_stem()}"
            )
        try:
            record = self.context.read_record_header(record_bytes, key)
            if record is None:
                return False  # written with another serde chain: kept, a miss
            if record.payload_len != target.nbytes:
                return RecordCorruptError(
                    f"record says {record.payload_len} bytes, the index {target.nbytes}"
                )
            copy_into(target, region.slot(local, target.nbytes))
            verify_payload(record, target)
        except RecordError as exc:
            # Without its traceback: the frames it holds reference buffers (a mapping's)
            # that must not outlive this call, and the error is kept and logged.
            return exc.with_traceback(None)
        if int(region.commits[local]) != entry.seq:
            # Reader counts keep slots from being reused under a load; this would mean
            # something else wrote the mapping meanwhile.
            self.context.count("generation_mismatch")
            self._burst.warn("generation", "dax: slot %d of %s changed during a load", local, region.path)
            return False
        return True

    def _remove_damaged(self, key: ObjectKey, entry: SlotEntry | None, error: RecordError) -> None:
        assert entry is not None
        if self.table.discard(key, entry):
            self.context.count("corrupt_records_removed")
            self._burst.warn("corrupt", "dax: %s removed: %s", key.file_stem(), str(error))

    # -- the rest of the backend protocol --------------------------------------------------

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self.table.delete(keys)

    def list_keys(self) -> list[tuple[ObjectKey, ObjectSize]]:
        return [(key, ObjectSize(entry.stored, entry.l1)) for key, entry in self.table.items()]

    def capacity(self) -> Capacity:
        return Capacity(objects=self.table.slot_count)

    def stats(self) -> dict[str, int]:
        return {"slots_total": self.table.slot_count, "slots_used": self.table.used_slots}

    def close(self) -> None:
        self._writers.shutdown()
        self._readers.shutdown()
        if not self._in_flight.drain(CLOSE_DRAIN_S):
            log.error("dax: mappings left in place: copies are still running")
            return
        for region in self.regions:
            region.close()
