"""``dax``: objects in fixed-size slots of memory-mapped DAX devices or files.

Core does pins, accounting, capacity admission, serde and the adapter threads;
``lmcache_plugin_raw_block.slotstore`` (shared with ``raw_block``) maps keys to slots and
verifies every load; this backend moves the bytes of slots spread over one or several
mappings (``mapping.py``).  A store copies the payload into a claimed slot, writes the
slot's index entry and commits it with one 8-byte store of the write's sequence number;
only then is the key published.  A load checks the entry, copies the slot out, verifies
the copy against the payload checksum and hands it back only if the commit word still
holds the same write (the slot's generation) after the copy, or none (the write was
replaced or deleted during the copy, its slot kept from reuse by the reader).  A slot's
commit word is cleared as soon as its write stops being its key's object, readers or not,
so a restart brings back exactly the published objects; a slot being read is reused only
once its readers are done.  Copies release the GIL, and a payload is
checksummed piece by piece as it is copied (core's ``copy_and_checksum`` /
``copy_verified``), so each byte crosses memory once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt
from lmcache_plugin_raw_block.guards import InFlight, probe_device, under_dev
from lmcache_plugin_raw_block.slotheader import SlotHeader, decode_slot_header, record_of
from lmcache_plugin_raw_block.slots import Claim, SlotEntry, SlotTable
from lmcache_plugin_raw_block.slotstore import SlotStoreBackend, as_bytes, newer_format

from lmcache_plugin_dax.config import DaxConfig
from lmcache_plugin_dax.layout import COMMIT_BYTES, ENTRY_BYTES
from lmcache_plugin_dax.mapping import DaxRegion
from lmcache_tiers.plugin import (
    BackendContext,
    ObjectKey,
    RecordError,
    RecordHeader,
    copy_and_checksum,
    copy_into,
    copy_verified,
)

log = logging.getLogger(__name__)

#: how long close() waits for copies that outlived the adapter's own wait
CLOSE_DRAIN_S = 10.0
#: bytes copied and hashed at a time when a batch's objects are stored on several threads
#: (one thread: core's STORE_PIECE, 256 KiB).  Each piece costs a thread two GIL
#: hand-backs, which cost more while the other thread wants the GIL: copying and hashing
#: on two threads, 1 MiB objects ran at 0.86-0.90x of a one-thread memcpy in 256 KiB
#: pieces and 0.97-1.04x in 512 KiB, 16 MiB objects at 1.38x and 1.42x (1 MiB pieces:
#: 0.98-1.04x and 1.29x).
PARALLEL_STORE_PIECE = 512 << 10
#: a store group of at least this many bytes (and two objects) is copied on all the store
#: workers; a smaller one on the calling thread, where handing it over would cost more
#: than the copies (a hand-off costs tens of microseconds, as long as a few hundred KiB
#: take to copy)
PARALLEL_STORE_BYTES = 1 << 20


def _interleave(counts: Sequence[int]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(region, local slot) of every global slot, the regions taken in turn, so that
    lowest-first allocation spreads objects (and bandwidth) over all mappings."""
    regions = np.concatenate([np.full(count, index, dtype=np.int64) for index, count in enumerate(counts)])
    locals_ = np.concatenate([np.arange(count, dtype=np.int64) for count in counts])
    order = np.lexsort((regions, locals_))
    return regions[order], locals_[order]


def first_write_number() -> int:
    """Where this run's write numbers start: the wall clock in nanoseconds.

    Recovery keeps the highest-numbered write of each key, over every mapping listed.  A
    mapping left out of an earlier run holds writes numbered by the runs that had it: had
    this run counted on from the highest number the mappings it has hold, a key it stores
    again could get a lower number than the same key's older write on a mapping listed
    again later, and that older write would win.  Numbers from the clock are higher than
    any earlier run's (at most one write a nanosecond), as long as the clock did not go
    back between the runs; recovery still starts above every write it found."""
    return time.time_ns()


class DaxBackend(SlotStoreBackend):
    """Backend over the slots of one or several mappings; see the module docstring."""

    type_name = "dax"
    too_large_hint = "raise slot_bytes"

    @staticmethod
    def preflight(config: DaxConfig) -> None:
        """Before L1 exists: every mapping is a character device or a file this user can
        create or open, and no other adapter holds it."""
        from lmcache_tiers.plugin import FieldError, check_file

        for index, device in enumerate(config.mappings()):
            field = f"devices[{index}].device_path" if config.devices else "device_path"
            path = device.device_path
            if not os.path.exists(path) and under_dev(os.path.realpath(path)):
                raise FieldError(field, f"{path} does not exist (no file is created under /dev)")
            check_file(device.device_path, field, devices="char")
            probe_device(device.device_path, field, "dax")

    def __init__(self, config: DaxConfig, context: BackendContext) -> None:
        self.config = config
        self._init_slot_store(context, config.slot_bytes, config.store_workers, config.load_workers)
        self._store_piece = None if config.store_workers == 1 else PARALLEL_STORE_PIECE
        self._in_flight = InFlight()
        # Commit words are cleared whenever the mappings are still mapped, not only while
        # calls may enter: a delete or replace a call finishes while close drains (or
        # after close gave up draining and left the mappings in place) must uncommit.
        self._mapped_lock = threading.Lock()
        self._unmapped = False
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
            self.table = SlotTable(sum(counts), on_unpublish=self._clear)
            reopened = [region.mount(keep=config.persist_enabled) for region in self.regions]
            # A mapping formatted drops whatever it held (logged by mount): counted too.
            self.context.count("device_formats", reopened.count(False))
            self._recover([index for index, kept in enumerate(reopened) if kept])
        except BaseException:
            self._stop_workers()
            for region in self.regions:
                region.discard()  # a refused start-up leaves no file it created behind
            raise

    def _place(self, slot: int) -> tuple[DaxRegion, int]:
        return self.regions[int(self._region_of[slot])], int(self._local_of[slot])

    def _clear(self, slot: int) -> None:
        """A slot's write is no longer its key's object: uncommit it at once (not when its
        readers leave, maybe after close or a crash), so a restart cannot bring it back --
        an older version, once the write that replaced it was deleted too."""
        region, local = self._place(slot)
        with self._mapped_lock:
            if not self._unmapped:
                region.clear(local)
                return
        # Only a call that outlived a close which drained (a damaged object found by a
        # load past its copies) gets here: its commit word stays, and the restart judges
        # that write again.
        self.context.count("uncommit_after_close")
        self._burst.warn(
            "uncommit_closed", "dax: slot %d of %s left committed: the mapping is closed", local, region.path
        )

    # -- start-up --------------------------------------------------------------------------

    def _recover(self, reopened: Sequence[int]) -> None:
        candidates, dropped = self._committed_writes(reopened)
        entries: list[tuple[ObjectKey, SlotEntry]] = []
        newer: list[tuple[ObjectKey, SlotEntry, RecordError]] = []
        corrupt = older = 0
        for key, writes in candidates.items():
            chosen, damaged = self._newest_readable(writes, newer)
            corrupt += damaged
            if chosen is not None:
                entries.append((key, chosen))
            older += len(writes) - damaged - (chosen is not None)
        superseded = self.table.restore(entries, next_seq=first_write_number())
        kept_newer = self._keep_newer_records(newer)
        for entry in superseded:
            self._clear(entry.slot)
        dropped += older + len(superseded)
        self.context.count("recovered_objects", len(entries) - len(superseded))
        self.context.count("recovery_dropped_slots", dropped)
        self.context.count("corrupt_records_removed", corrupt)
        if reopened:
            log.info(
                "dax: %d objects recovered from %d mappings (%d of a newer format, kept as "
                "misses), %d index entries dropped",
                len(entries) - len(superseded),
                len(reopened),
                kept_newer,
                dropped + corrupt,
            )

    def _committed_writes(self, reopened: Sequence[int]) -> tuple[dict[ObjectKey, list[SlotHeader]], int]:
        """The header of every committed slot whose index entry decodes, by key, its
        ``slot`` the table's (global) number; the others are uncommitted and counted."""
        writes: dict[ObjectKey, list[SlotHeader]] = {}
        dropped = 0
        for index in reopened:
            region = self.regions[index]
            damaged: list[int] = []
            for local, seq in region.committed():
                header = decode_slot_header(region.entry_header(local), region.identity, local)
                if header is None or header.seq != seq or header.stored > self.config.slot_bytes:
                    region.clear(local)
                    damaged.append(local)
                    continue
                global_slot = int(self._global_of[index][local])
                writes.setdefault(header.key, []).append(replace(header, slot=global_slot))
            if damaged:
                # A commit word is stored after its entry is whole: these are damage.
                log.warning(
                    "dax: %s: %d committed index entries dropped: they do not verify (crc, "
                    "identity, slot, commit word or size), e.g. slot %d",
                    region.path,
                    len(damaged),
                    damaged[0],
                )
                dropped += len(damaged)
        return writes, dropped

    def _newest_readable(
        self, writes: list[SlotHeader], newer: list[tuple[ObjectKey, SlotEntry, RecordError]]
    ) -> tuple[SlotEntry | None, int]:
        """The newest of one key's committed writes whose record is not damaged, and how
        many damaged ones were dropped on the way; every other one is uncommitted.

        Only the write chosen has its record judged (a damaged one is dropped and the next
        older judged): judging a superseded record of another serde chain would make the
        key a miss (``serde_chain_mismatch``) though its newest write reads fine."""
        chosen: SlotEntry | None = None
        damaged = 0
        for header in sorted(writes, key=lambda write: write.seq, reverse=True):
            if chosen is not None:
                self._clear(header.slot)
                continue
            entry = SlotEntry(header.slot, header.seq, header.stored, header.l1)
            try:
                self.context.read_record_header(header.record, header.key)
            except RecordError as exc:
                if not newer_format(exc):
                    self._clear(header.slot)
                    damaged += 1
                    region, local = self._place(header.slot)
                    stem = header.key.file_stem()
                    log.warning("dax: %s slot %d (%s) dropped: %s", region.path, local, stem, exc)
                    continue
                # Intact, of a newer server: its key's object, a miss until replaced
                # (newer_format), counted and logged once the table is restored.
                newer.append((header.key, entry, exc))
            chosen = entry
        return chosen, damaged

    # -- moving one slot (the rest is SlotStoreBackend's) ---------------------------------

    @property
    def header_room(self) -> int:
        return ENTRY_BYTES - COMMIT_BYTES

    def _slot_place(self, slot: int) -> tuple[bytes, int]:
        region, local = self._place(slot)
        return region.identity, local

    def _store_group(
        self, keys: list[ObjectKey], payloads: list[memoryview], claims: list[Claim]
    ) -> list[bool]:
        # Two rounds: every payload is copied into its slot (on the store workers), then
        # every slot's header is written and committed and its key published (on this
        # thread).  The copies then run back to back, each worker holding the GIL only to
        # take the next object, and the headers are encoded in one tight loop whose code
        # and data stay in cache, rather than after each copy evicted them: 1 MiB stores
        # ran about 10 % faster so.  A slot's bytes still precede its header, and its header
        # its commit word, so a crash between the rounds leaves uncommitted slots only.
        with self._in_flight.use() as usable:
            if usable:
                data = [as_bytes(payload) for payload in payloads]
                large = len(data) > 1 and sum(view.nbytes for view in data) >= PARALLEL_STORE_BYTES
                copied = self._writers.map(self._copy_or_error, claims, data, parallel=large)
                return self._writers.map(self._store_one, keys, data, claims, copied, parallel=False)
        if claims:  # closed since put_many's closing check: counted as that check counts
            self._stopped_closing("store", len(claims))
        for claim in claims:
            self.table.abandon(claim)
        return [False] * len(claims)

    def _copy_or_error(self, claim: Claim, payload: memoryview) -> bytes | BaseException:
        """The checksum of the copy, or what the copy raised: ``_store_one`` settles it."""
        try:
            return self._copy_payload(claim, payload)
        except BaseException as exc:
            return exc

    def _copy_payload(self, claim: Claim, payload: memoryview) -> bytes:
        # Copied and checksummed piece by piece, each piece hashed in the slot while it is
        # still in cache: one pass over the bytes instead of two, and the checksum is that
        # of the bytes the slot holds.
        region, local = self._place(claim.slot)
        return copy_and_checksum(region.slot(local, payload.nbytes), payload, piece=self._store_piece)

    def _write_slot(self, claim: Claim, header: bytes, payload: memoryview) -> None:
        # The payload is in the slot already (_copy_payload); the commit word goes last.
        region, local = self._place(claim.slot)
        region.write_entry(local, header, claim.seq)

    def _load_group(
        self, keys: list[ObjectKey], entries: list[SlotEntry | None], buffers: list[memoryview]
    ) -> list[bool | RecordError]:
        with self._in_flight.use() as usable:
            if usable:
                return super()._load_group(keys, entries, buffers)
        if keys:  # as _load_one counts a close it sees
            self._stopped_closing("load", len(keys))
        return [False] * len(keys)

    def _fetch(self, entry: SlotEntry, key: ObjectKey, target: memoryview) -> bytes | None:
        region, local = self._place(entry.slot)
        return record_of(region.entry_header(local), region.identity, local, entry.seq, key)

    def _fill(self, entry: SlotEntry, target: memoryview) -> None:
        region, local = self._place(entry.slot)
        copy_into(target, region.slot(local, target.nbytes))

    def _fill_verified(self, entry: SlotEntry, target: memoryview, record: RecordHeader) -> None:
        # Each piece is hashed in the caller's buffer right after it was copied there.
        region, local = self._place(entry.slot)
        copy_verified(target, region.slot(local, target.nbytes), record)

    def _still_current(self, entry: SlotEntry) -> bool:
        region, local = self._place(entry.slot)
        if int(region.commits[local]) in (entry.seq, 0):
            # 0: replaced or deleted during the copy (uncommitted then), the slot kept from
            # reuse by this reader; the copy, verified, is still that write's bytes.
            return True
        # Reader counts keep slots from being reused under a load: this means something
        # else wrote the mapping meanwhile.
        self.context.count("generation_mismatch")
        self._burst.warn("generation", "dax: slot %d of %s changed during a load", local, region.path)
        return False

    # -- the rest of the backend protocol --------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {"slots_total": self.table.slot_count, "slots_used": self.table.used_slots}

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        # Inside the in-flight count, so that the commit words of what it deletes are
        # cleared before close unmaps; once close drained, refused (a delete acknowledged
        # then would leave its key committed, and the restart would bring it back).
        with self._in_flight.use() as usable:
            if usable:
                return super().delete_many(keys)
        self.context.count("delete_stopped_closing", len(keys))
        self._burst.warn("delete_closing", "dax: %d keys not deleted: the adapter is closed", len(keys))
        return [False] * len(keys)

    def close(self) -> None:
        self._stop_workers()
        drained = self._in_flight.drain(CLOSE_DRAIN_S)
        try:
            # Even when the drain gave up: the mapping stays mapped then, and a slot
            # unpublished by a call that finished meanwhile must not come back at the next
            # start.  Should it raise, the close still unmaps (and gives the lock back) and
            # then fails (core counts it and fails the stop).  No old version comes back
            # by it: a replaced or deleted write was uncommitted when it was unpublished
            # (_clear), and the next start keeps only each key's newest committed write.
            self._uncommit_unpublished()
        finally:
            if drained:
                self._unmap()
        if not drained:
            log.error("dax: mappings left in place: copies are still running")

    def _unmap(self) -> None:
        with self._mapped_lock:
            self._unmapped = True
        for region in self.regions:
            region.close()

    def _uncommit_unpublished(self) -> None:
        """Clear the commit word of every slot no key publishes and no store has claimed.

        Under the table's lock, so no store claims or publishes one of those slots
        meanwhile: a store still running (close gave up waiting for it) keeps its claimed
        slot's word, and a slot claimed later is cleared before its copy begins."""
        cleared = 0

        def clear(held: npt.NDArray[np.int64]) -> None:
            nonlocal cleared
            kept = [np.zeros(region.layout.slot_count, dtype=bool) for region in self.regions]
            for index, local in zip(self._region_of[held], self._local_of[held], strict=True):
                kept[int(index)][int(local)] = True
            for region, keep in zip(self.regions, kept, strict=True):
                stale = (region.commits != 0) & ~keep
                cleared += int(np.count_nonzero(stale))
                region.commits[stale] = 0

        self.table.with_held_slots(clear)
        if cleared:
            self.context.count("uncommitted_at_close", cleared)
            log.info("dax: %d slots neither published nor being stored uncommitted at close", cleared)
