"""``raw_block``: objects in the fixed-size slots of a block device or a preallocated file.

Core does pins, accounting, capacity admission, serde and the adapter threads; this
backend maps keys to slots (``slots.py``), moves whole slots with one system call each
(``slotio.py``), checkpoints the index (``checkpoint.py``) and rebuilds it at start-up
(``recovery.py``).  A store claims fresh slots lowest first, a few dozen at a time,
writes each slot's header and payload together and publishes the key only then; a load
reads header and payload together and hands back bytes only when the slot header names
the key and write it expects, the record header verifies and the payload matches its
checksum.  A damaged slot is a miss: the object is removed and counted.  The device holds
``slot_count`` objects, whatever their sizes (``Capacity(objects=...)``).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Sequence

from lmcache_plugin_raw_block.checkpoint import Checkpoint, CheckpointAreas, CheckpointTooLarge
from lmcache_plugin_raw_block.config import RawBlockConfig
from lmcache_plugin_raw_block.device import BlockDevice, open_device
from lmcache_plugin_raw_block.geometry import Geometry, plan_geometry
from lmcache_plugin_raw_block.parallel import Workers
from lmcache_plugin_raw_block.recovery import CLAIM_GROUP, recover
from lmcache_plugin_raw_block.slotheader import encode_slot_header, record_of
from lmcache_plugin_raw_block.slotio import SlotIO
from lmcache_plugin_raw_block.slots import Claim, SlotEntry, SlotTable
from lmcache_plugin_raw_block.superblock import (
    SIGNATURE_PROBE_BYTES,
    decode_superblock,
    encode_superblock,
    foreign_signature,
    has_magic,
    new_identity,
)
from lmcache_tiers.plugin import (
    BackendContext,
    BurstLog,
    Capacity,
    ConfigError,
    ObjectKey,
    ObjectSize,
    RecordCorruptError,
    RecordError,
    verify_payload,
)

log = logging.getLogger(__name__)

SUPERBLOCK_MAGIC = b"LMTRBLK1"
#: how long close() waits for device calls that outlived the adapter's own wait
CLOSE_DRAIN_S = 10.0


def _reformat_reason(found: bytes, magic_ok: bool, geometry: Geometry, config: RawBlockConfig) -> str | None:
    """Why the device must be formatted (None: reopen it), or raise if it must not be."""
    superblock = decode_superblock(found, SUPERBLOCK_MAGIC)
    if superblock is not None:
        if not config.load_checkpoint_on_init:
            return "load_checkpoint_on_init is false"
        if superblock.geometry != geometry.as_dict():
            changed = sorted(
                f"{name} {superblock.geometry.get(name)} -> {value}"
                for name, value in geometry.as_dict().items()
                if superblock.geometry.get(name) != value
            )
            return "its geometry changed (" + ", ".join(changed) + ")"
        return None
    if magic_ok:
        return "its superblock is damaged"
    foreign = foreign_signature(found)
    if foreign is not None:
        raise ConfigError(
            f"raw_block: {config.device_path} holds {foreign}; refusing to overwrite it "
            "(erase its signatures first, e.g. with wipefs, if it is meant for raw_block)"
        )
    return "it holds no raw_block superblock"


class RawBlockBackend:
    """Backend over the slots of one device; see the module docstring."""

    # One store thread: recovery relies on at most CLAIM_GROUP writes being in flight.
    # Loads and stores use worker pools of their own for parallel I/O within a batch.
    concurrency = 1

    def __init__(self, config: RawBlockConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self._burst = BurstLog()
        self._device: BlockDevice = open_device(config)
        self._stop = threading.Event()
        self._checkpoint_lock = threading.Lock()
        self._checkpointed_version = -1
        self._thread: threading.Thread | None = None
        self._readers = Workers(config.num_load_workers, "raw-block-load")
        self._writers = Workers(config.num_store_workers, "raw-block-store")
        try:
            self.geometry = plan_geometry(config, self._device.size)
            self._io = SlotIO(self._device, self.geometry)
            self.table = SlotTable(self.geometry.slot_count)
            reopened, checkpoint = self._mount()
            if reopened:
                self._recover(checkpoint)
            self.checkpoint(force=True)
        except BaseException:
            self._readers.shutdown()
            self._writers.shutdown()
            self._device.close(0.0)
            raise
        if config.meta_enable_periodic:
            self._thread = threading.Thread(
                target=self._checkpoint_loop, name=f"raw-block-checkpoint-{context.name}", daemon=True
            )
            self._thread.start()

    # -- start-up --------------------------------------------------------------------------

    def _mount(self) -> tuple[bool, Checkpoint | None]:
        """Reopen the device's layout, or format it: (reopened, checkpoint to recover from)."""
        device, geometry = self._device, self.geometry
        found = device.read_at(0, min(SIGNATURE_PROBE_BYTES, geometry.meta_total_bytes))
        reason = _reformat_reason(found, has_magic(found, SUPERBLOCK_MAGIC), geometry, self.config)
        if reason is None:
            superblock = decode_superblock(found, SUPERBLOCK_MAGIC)
            assert superblock is not None
            self.identity = superblock.identity
            self._areas = CheckpointAreas(device, geometry, self.identity)
            checkpoint = self._areas.read_newest()
            if checkpoint is None:
                log.warning("raw_block: %s has no valid checkpoint; reading every slot header", device.path)
            return True, checkpoint
        # Formatting a blank device is routine; formatting over a cache drops its objects.
        level = logging.WARNING if found.strip(b"\0") else logging.INFO
        log.log(
            level,
            "raw_block: formatting %s (%s): %d slots of %d bytes",
            device.path,
            reason,
            geometry.slot_count,
            geometry.slot_bytes,
        )
        self.context.count("device_formats")
        self.identity = new_identity()
        self._areas = CheckpointAreas(device, geometry, self.identity)
        self._areas.invalidate()
        device.write_at(0, encode_superblock(SUPERBLOCK_MAGIC, self.identity, geometry.as_dict()))
        device.sync()
        return False, None

    def _recover(self, checkpoint: Checkpoint | None) -> None:
        result = recover(
            self.geometry.slot_count,
            self.identity,
            checkpoint,
            verify=self.config.meta_verify_on_load,
            read_headers=self._read_headers,
            context=self.context,
        )
        superseded = self.table.restore(result.entries, result.next_seq)
        counts = {
            "recovered_from_checkpoint": result.from_checkpoint,
            "recovered_from_headers": result.from_headers,
            "recovery_dropped_slots": result.dropped + len(superseded),
            "corrupt_records_removed": result.corrupt,
            "recovery_headers_read": result.headers_read,
        }
        for name, amount in counts.items():
            self.context.count(name, amount)
        log.info(
            "raw_block: %s: %d objects recovered (%d from checkpoint %d, %d from slot headers), "
            "%d slots dropped, %d slot headers read",
            self._device.path,
            len(result.entries) - len(superseded),
            result.from_checkpoint,
            checkpoint.seq if checkpoint is not None else 0,
            result.from_headers,
            result.dropped + len(superseded) + result.corrupt,
            result.headers_read,
        )

    def _read_headers(self, slots: Sequence[int]) -> list[bytes | None]:
        def read(slot: int) -> bytes | None:
            try:
                return self._io.read_header(slot)
            except OSError as exc:
                self.context.count("slot_read_errors")
                self._burst.warn("read", "raw_block: cannot read the header of slot %d: %s", slot, exc)
                return None

        return self._readers.map(read, slots)

    # -- checkpoints -----------------------------------------------------------------------

    def checkpoint(self, *, force: bool = False) -> bool:
        """Write the index as the next checkpoint if it changed (or ``force``)."""
        with self._checkpoint_lock:
            snapshot = self.table.snapshot()
            if not force and snapshot.version == self._checkpointed_version:
                return False
            try:
                with self._device.in_flight.use() as usable:
                    if not usable:
                        return False
                    self._areas.write(snapshot)
            except CheckpointTooLarge as exc:
                self.context.count("checkpoint_too_large")
                self._burst.warn(
                    "checkpoint_size",
                    "raw_block: %s: checkpoint skipped: %s; raise meta_total_bytes "
                    "(recovery after a crash reads more slot headers meanwhile)",
                    self._device.path,
                    exc,
                )
                return False
            except OSError as exc:
                self.context.count("checkpoint_failures")
                self._burst.warn("checkpoint", "raw_block: %s: checkpoint failed: %s", self._device.path, exc)
                return False
            self._checkpointed_version = snapshot.version
            self.context.count("checkpoints_written")
            return True

    def _checkpoint_loop(self) -> None:
        while not self._stop.wait(self.config.meta_checkpoint_interval_sec):
            self.checkpoint()

    # -- stores ----------------------------------------------------------------------------

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        results = [False] * len(keys)
        limit = self.geometry.payload_bytes
        fitting = []
        for index, payload in enumerate(payloads):
            if payload.nbytes <= limit:
                fitting.append(index)
                continue
            self.context.count("object_too_large")
            self._burst.warn(
                "too_large",
                "raw_block: %s not stored: %d bytes exceed a slot's payload of %d "
                "(slot_bytes - header_bytes); raise slot_bytes",
                keys[index].file_stem(),
                payload.nbytes,
                limit,
            )
        for start in range(0, len(fitting), CLAIM_GROUP):
            group = fitting[start : start + CLAIM_GROUP]
            claims = self.table.claim(len(group))
            if len(claims) < len(group):
                self.context.count("no_free_slot", len(group) - len(claims))
                self._burst.warn(
                    "no_slot", "raw_block: %d objects not stored: no free slot", len(group) - len(claims)
                )
            chosen = group[: len(claims)]
            stored = self._writers.map(
                self._store_one, [keys[i] for i in chosen], [payloads[i] for i in chosen], claims
            )
            for index, ok in zip(chosen, stored, strict=True):
                results[index] = ok
        return results

    def _store_one(self, key: ObjectKey, payload: memoryview, claim: Claim) -> bool:
        quarantine = False
        try:
            data = payload if payload.format == "B" else payload.cast("B")
            record = self.context.record_header(key, data)
            l1 = self.context.l1_size_of(key) or data.nbytes
            header = encode_slot_header(self.identity, claim.slot, claim.seq, key, data.nbytes, l1, record)
            if len(header) > self.geometry.header_bytes:
                self.context.count("header_too_large")
                self._burst.warn(
                    "header_size",
                    "raw_block: %s not stored: its header needs %d bytes, header_bytes is %d",
                    key.file_stem(),
                    len(header),
                    self.geometry.header_bytes,
                )
            else:
                self._io.write(claim.slot, header, data)
                self.table.publish(key, SlotEntry(claim.slot, claim.seq, data.nbytes, l1))
                return True
        except ValueError as exc:  # a record header that cannot be encoded
            self.context.count("header_too_large")
            self._burst.warn("header", "raw_block: %s not stored: %s", key.file_stem(), exc)
        except OSError as exc:
            quarantine = exc.errno != errno.EBADF
            self.context.count("slot_write_errors")
            self._burst.warn("write", "raw_block: writing slot %d failed: %s", claim.slot, exc)
        except BaseException:
            self.table.abandon(claim)
            raise
        self.table.abandon(claim, quarantine=quarantine)
        return False

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
        target = buffer if buffer.format == "B" else buffer.cast("B")
        try:
            block = self._io.read(entry.slot, target)
        except OSError as exc:
            self.context.count("slot_read_errors")
            self._burst.warn("read", "raw_block: reading slot %d failed: %s", entry.slot, exc)
            return False
        record_bytes = record_of(block, self.identity, entry.slot, entry.seq, key)
        if record_bytes is None:
            return RecordCorruptError(
                f"the header of slot {entry.slot} is damaged or not that of write {entry.seq} of "
                f"{key.file_stem()}"
            )
        try:
            record = self.context.read_record_header(record_bytes, key)
            if record is None:
                return False  # written with another serde chain: kept, a miss
            if record.payload_len != target.nbytes:
                return RecordCorruptError(
                    f"record says {record.payload_len} bytes, the index {target.nbytes}"
                )
            verify_payload(record, target)
        except RecordError as exc:
            # Without its traceback: the frames it holds reference buffers (a mapping's)
            # that must not outlive this call, and the error is kept and logged.
            return exc.with_traceback(None)
        return True

    def _remove_damaged(self, key: ObjectKey, entry: SlotEntry | None, error: RecordError) -> None:
        assert entry is not None
        if self.table.discard(key, entry):
            self.context.count("corrupt_records_removed")
            self._burst.warn(
                "corrupt", "raw_block: %s in slot %d removed: %s", key.file_stem(), entry.slot, str(error)
            )

    # -- the rest of the backend protocol --------------------------------------------------

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self.table.delete(keys)

    def list_keys(self) -> list[tuple[ObjectKey, ObjectSize]]:
        return [(key, ObjectSize(entry.stored, entry.l1)) for key, entry in self.table.items()]

    def capacity(self) -> Capacity:
        return Capacity(objects=self.geometry.slot_count)

    def stats(self) -> dict[str, int]:
        return {
            "slots_total": self.geometry.slot_count,
            "slots_used": self.table.used_slots,
            "slots_quarantined": self.table.quarantined_slots,
            "checkpoint_seq": self._areas.seq,
        }

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.checkpoint(force=True)
        self._writers.shutdown()
        self._readers.shutdown()
        if self._device.in_flight.drain(CLOSE_DRAIN_S):
            self._io.close()
        self._device.close(0.0)
