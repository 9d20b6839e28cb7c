"""``raw_block``: objects in the fixed-size slots of a block device or a preallocated file.

Core does pins, accounting, capacity admission, serde and the adapter threads;
``slotstore.py`` (shared with ``dax``) maps keys to slots and verifies every load; this
backend moves whole slots with one system call each (``slotio.py``), checkpoints the
index (``checkpoint.py``) and rebuilds it at start-up (``recovery.py``).  A store claims
fresh slots lowest first, a few dozen at a time, writes each slot's header and payload
together and publishes the key only then; a load reads header and payload together and
hands back bytes only when the slot header names the key and write it expects, the
record header verifies and the payload matches its checksum.  A damaged slot is a miss:
the object is removed and counted.  The device holds ``slot_count`` objects, whatever
their sizes (``Capacity(objects=...)``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence

from lmcache_plugin_raw_block.checkpoint import Checkpoint, CheckpointAreas, CheckpointTooLarge
from lmcache_plugin_raw_block.config import RawBlockConfig
from lmcache_plugin_raw_block.device import BlockDevice, open_device, preflight_device
from lmcache_plugin_raw_block.geometry import Geometry, plan_geometry
from lmcache_plugin_raw_block.recovery import UNSAVED_QUARANTINE_MAX, recover
from lmcache_plugin_raw_block.slotheader import record_of
from lmcache_plugin_raw_block.slotio import SlotIO
from lmcache_plugin_raw_block.slots import Claim, SlotEntry, SlotTable
from lmcache_plugin_raw_block.slotstore import SlotStoreBackend
from lmcache_plugin_raw_block.superblock import (
    RAW_BLOCK_MAGIC,
    SIGNATURE_PROBE_BYTES,
    decode_superblock,
    encode_superblock,
    foreign_signature,
    has_magic,
    new_identity,
    own_block,
    unreadable_reason,
)
from lmcache_tiers.plugin import BackendContext, ConfigError, ObjectKey

log = logging.getLogger(__name__)

SUPERBLOCK_MAGIC = RAW_BLOCK_MAGIC
#: how long close() waits, all told, for its last checkpoint (writes and fsync) and the
#: device calls still running: a device that stopped answering must not hold up the
#: server's shutdown, so what is still stuck then is left behind, logged and counted
CLOSE_DRAIN_S = 10.0


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _reformat_reason(found: bytes, magic_ok: bool, geometry: Geometry, config: RawBlockConfig) -> str | None:
    """Why the device must be formatted (None: reopen it), or raise if it must not be."""
    superblock = decode_superblock(found, SUPERBLOCK_MAGIC)
    # Our superblock's block holds the superblock and zeros: a signature in it was written
    # there since (a filesystem or partition table made over the device that left its
    # first bytes alone), and the device is no longer ours to write.
    within = own_block(found, SUPERBLOCK_MAGIC, geometry.block_align) if magic_ok else None
    foreign = foreign_signature(found, SUPERBLOCK_MAGIC, within=within)
    if foreign is not None:
        raise ConfigError(
            f"raw_block: {config.device_path} holds {foreign}; refusing to overwrite it "
            "(if it is meant for raw_block, erase its signatures first: wipefs, or zero its first 68 KiB)"
        )
    if superblock is not None:
        # A cache of ours, emptied: said so, as the operator's edit may not have meant it.
        if not config.load_checkpoint_on_init:
            return "load_checkpoint_on_init is false; its objects are dropped"
        if superblock.geometry != geometry.as_dict():
            changed = sorted(
                f"{name} {superblock.geometry.get(name)} -> {value}"
                for name, value in geometry.as_dict().items()
                if superblock.geometry.get(name) != value
            )
            return "its geometry changed (" + ", ".join(changed) + "); its objects are dropped"
        return None
    if magic_ok:
        return unreadable_reason(found)
    return "it holds no raw_block superblock"


class RawBlockBackend(SlotStoreBackend):
    """Backend over the slots of one device; see the module docstring."""

    type_name = "raw_block"
    too_large_hint = "raise slot_bytes (a slot's payload is slot_bytes - header_bytes)"

    @staticmethod
    def preflight(config: RawBlockConfig) -> None:
        preflight_device(config)

    def __init__(self, config: RawBlockConfig, context: BackendContext) -> None:
        self.config = config
        self._init_slot_store(
            context, config.payload_bytes, config.num_store_workers, config.num_load_workers
        )
        self._device: BlockDevice = open_device(config)
        self._stop = threading.Event()
        # Held while a delete changes the table and while close sets _stop: every delete
        # accepted is in the checkpoint close takes next (a delete writes nothing to the
        # device), and one arriving later is refused rather than undone by the restart.
        self._delete_gate = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._checkpointed_version = -1
        #: the device's newest checkpoint is one written at a clean shutdown: until a
        #: checkpoint of this run supersedes it, a restart may trust it (see _stores_paused)
        self._clean_checkpoint_newest = False
        self._thread: threading.Thread | None = None
        try:
            self.geometry = plan_geometry(config, self._device.size)
            self._io = SlotIO(self._device, self.geometry)
            self.table = SlotTable(self.geometry.slot_count)
            reopened, checkpoint = self._mount()
            if reopened:
                self._recover(checkpoint)
            self.checkpoint(force=True)
        except BaseException:
            self._stop_workers()
            self._device.close(0.0)
            self._device.remove_if_created()
            raise
        #: a periodic checkpoint's unexpected failure was logged with its traceback
        self._checkpoint_crash_logged = False
        if config.meta_enable_periodic:
            self._thread = threading.Thread(
                target=self._checkpoint_loop, name=f"raw-block-checkpoint-{context.name}", daemon=True
            )
            self._thread.start()

    # -- start-up --------------------------------------------------------------------------

    def _mount(self) -> tuple[bool, Checkpoint | None]:
        """Reopen the device's layout, or format it: (reopened, checkpoint to recover from)."""
        device, geometry = self._device, self.geometry
        # The whole probe, whatever meta_total_bytes is: signatures lie up to 64 KiB + 64
        # in (btrfs), which slots overwrite when the metadata region is smaller than that.
        found = device.read_at(0, min(SIGNATURE_PROBE_BYTES, device.size))
        reason = _reformat_reason(found, has_magic(found, SUPERBLOCK_MAGIC), geometry, self.config)
        if reason is None:
            superblock = decode_superblock(found, SUPERBLOCK_MAGIC)
            assert superblock is not None
            self.identity = superblock.identity
            self._areas = CheckpointAreas(device, geometry, self.identity)
            checkpoint = self._areas.read_newest()
            if self._areas.unusable:
                self.context.count("checkpoints_unusable", self._areas.unusable)
            # A newer checkpoint passed over (unreadable for the moment) may be a clean one,
            # and trusted once it reads again: it counts as such until one supersedes it.
            self._clean_checkpoint_newest = self._areas.newer_passed_over or (
                checkpoint is not None and checkpoint.clean
            )
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

    def _verify_checkpoint(self, checkpoint: Checkpoint | None) -> bool:
        """Whether recovery reads the slot headers of the checkpoint's objects.

        ``meta_verify_on_load`` false trusts a checkpoint written at shutdown only, and
        only while it is the newest: a newer one passed over (damaged, unreadable) means a
        later run wrote and stored after it.  After a crash a checkpointed slot may have
        been freed and rewritten with another key's acknowledged store, which only its
        header tells: trusting the checkpoint there would lose that store silently.
        """
        if self.config.meta_verify_on_load or checkpoint is None:
            return self.config.meta_verify_on_load
        if checkpoint.clean and not self._areas.newer_passed_over:
            return False
        why = "a newer one could not be used" if checkpoint.clean else "it is not from a clean shutdown"
        log.info(
            "raw_block: %s: checkpoint %d cannot be trusted unread (%s); checking its slot "
            "headers although meta_verify_on_load is false",
            self._device.path,
            checkpoint.seq,
            why,
        )
        return True

    def _recover(self, checkpoint: Checkpoint | None) -> None:
        result = recover(
            self.geometry.slot_count,
            self.identity,
            checkpoint,
            verify=self._verify_checkpoint(checkpoint),
            read_headers=self._read_headers,
            context=self.context,
        )
        superseded = self.table.restore(result.entries, result.next_seq)
        newer = self._keep_newer_records(result.newer)
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
            "raw_block: %s: %d objects recovered (%d from checkpoint %d, %d from slot headers; "
            "%d of a newer format, kept as misses), %d slots dropped, %d slot headers read",
            self._device.path,
            len(result.entries) - len(superseded),
            result.from_checkpoint,
            checkpoint.seq if checkpoint is not None else 0,
            result.from_headers,
            newer,
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
            # Once close began no store or delete starts any more: a checkpoint taken now
            # is the device's final state, which a restart may trust without reading slots.
            clean = self._stop.is_set()
            snapshot = self.table.snapshot()
            if not force and snapshot.version == self._checkpointed_version:
                return False
            try:
                with self._device.in_flight.use() as usable:
                    if not usable:
                        return False
                    self._areas.write(snapshot, clean=clean)
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
            # Not yet superseded while an area whose header could not be read is not
            # overwritten (both were unread at start-up: the next checkpoint does it).
            self._clean_checkpoint_newest = self._areas.newer_passed_over
            self.table.saved(snapshot)
            self.context.count("checkpoints_written")
            return True

    def _stores_paused(self) -> str | None:
        if self._clean_checkpoint_newest:
            # A restart after a crash trusts a clean checkpoint without reading the slots
            # it lists (meta_verify_on_load false); a store into one of them, freed since,
            # would be seen by nobody.  Normally the start-up checkpoint supersedes it.
            # (Forced: an unchanged index still has an area left to overwrite.)
            self.checkpoint(force=True)
            if self._clean_checkpoint_newest:
                return (
                    "no checkpoint could be written since the one of the last clean shutdown, "
                    "which a restart after a crash would trust, missing any later write into a "
                    "slot it lists; stores are paused until a checkpoint succeeds"
                )
        # Recovery finds the writes made after the last checkpoint among the slots free
        # at it and stops at a run of empty ones (recovery.SCAN_WINDOW); a slot
        # quarantined since then is empty, so enough of them in a row would hide every
        # later write after a crash.  A checkpoint lists them as watched instead.
        if self.table.unsaved_quarantines < UNSAVED_QUARANTINE_MAX:
            return None
        self.checkpoint()
        backlog = self.table.unsaved_quarantines
        if backlog < UNSAVED_QUARANTINE_MAX:
            return None
        return (
            f"{backlog} slots failed with I/O errors since the last checkpoint and no "
            "checkpoint could be written; a crash would hide any later write from recovery, "
            "so stores are paused until a checkpoint succeeds"
        )

    def _checkpoint_loop(self) -> None:
        while not self._stop.wait(self.config.meta_checkpoint_interval_sec):
            try:
                self.checkpoint()
            except Exception:
                self._periodic_checkpoint_crashed()

    def _periodic_checkpoint_crashed(self) -> None:
        """A periodic checkpoint raised something other than an I/O error (those are counted
        in ``checkpoint``): a bug.  Counted and logged with its traceback (once per burst),
        and retried at the next interval: ending the thread would stop the checkpoints for
        good, each crash then recovering from an ever older one."""
        self.context.count("checkpoint_failures")
        if self._checkpoint_crash_logged:
            # Named without its traceback: a later failure may be another bug than the first.
            error = sys.exc_info()[1]
            self._burst.warn(
                "checkpoint",
                "raw_block: %s: periodic checkpoint failed again: %s: %s",
                self._device.path,
                type(error).__name__,
                error,
            )
            return
        self._checkpoint_crash_logged = True
        log.exception(
            "raw_block: %s: periodic checkpoint failed; retried every %d s",
            self._device.path,
            self.config.meta_checkpoint_interval_sec,
        )

    # -- moving one slot (the rest is SlotStoreBackend's) ---------------------------------

    @property
    def header_room(self) -> int:
        return self.geometry.header_bytes

    def _slot_place(self, slot: int) -> tuple[bytes, int]:
        return self.identity, slot

    def _write_slot(self, claim: Claim, header: bytes, payload: memoryview) -> None:
        self._io.write(claim.slot, header, payload)

    def _fetch(self, entry: SlotEntry, key: ObjectKey, target: memoryview) -> bytes | None:
        # Header and payload in one read; the payload is verified once the header is.
        block = self._io.read(entry.slot, target)
        return record_of(block, self.identity, entry.slot, entry.seq, key)

    def _fill(self, entry: SlotEntry, target: memoryview) -> None:
        """Nothing to do: :meth:`_fetch` read the payload with the header."""

    # -- the rest of the backend protocol --------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {
            "slots_total": self.geometry.slot_count,
            "slots_used": self.table.used_slots,
            "slots_quarantined": self.table.quarantined_slots,
            "checkpoint_seq": self._areas.seq,
        }

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Refused once close began: core does not wait for a delete on its caller's
        thread, and one accepted after the checkpoint at close would be answered True and
        undone by the restart, which trusts that checkpoint."""
        with self._delete_gate:
            if not self._stop.is_set():
                return self.table.delete(keys)
        self.context.count("delete_stopped_closing", len(keys))
        self._burst.warn(
            "delete_closing",
            "raw_block: %d keys not deleted: the adapter is closing (its last checkpoint keeps them)",
            len(keys),
        )
        return [False] * len(keys)

    def close(self) -> None:
        deadline = time.monotonic() + CLOSE_DRAIN_S
        with self._delete_gate:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(_left(deadline))  # its checkpoint may be stuck in the device
        try:
            self._final_checkpoint(deadline)
        finally:
            self._stop_workers()
            # A call still stuck keeps the descriptor (and the staging blocks it may use).
            if self._device.in_flight.drain(_left(deadline)):
                self._io.close()
            self._device.close(0.0)

    def _final_checkpoint(self, deadline: float) -> None:
        """The checkpoint at close, on a thread of its own so that close returns by
        ``deadline`` even when its writes or fsync never finish (a stalled device); a
        checkpoint left behind may still land, and if it does not, the next start reads
        slot headers for what the older checkpoint misses.

        A delete writes nothing to the device: a checkpoint at close that failed or did
        not finish leaves the next start to an older checkpoint that still lists the keys
        deleted since, which come back.  The close then raises
        :class:`CloseCheckpointFailed` (core counts it and fails the stop)."""
        failures: list[BaseException] = []
        written: list[bool] = []

        def write() -> None:
            try:
                written.append(self.checkpoint(force=True))
            except BaseException as exc:  # raised in close, as if close had written it
                failures.append(exc)

        writer = threading.Thread(target=write, name=f"raw-block-close-{self.context.name}", daemon=True)
        writer.start()
        writer.join(_left(deadline))
        if writer.is_alive():
            self.context.count("close_checkpoint_timeouts")
            log.error(
                "raw_block: %s: the checkpoint at close did not finish within %.0f s (the device "
                "stopped answering?); closing without waiting for it",
                self._device.path,
                CLOSE_DRAIN_S,
            )
            raise CloseCheckpointFailed(self._device.path, "it did not finish in time")
        if failures:
            raise failures[0]
        if written != [True] and not self._index_unchanged_since_checkpoint():
            # checkpoint() counted and logged why (checkpoint_failures, checkpoint_too_large).
            raise CloseCheckpointFailed(self._device.path, "it failed")

    def _index_unchanged_since_checkpoint(self) -> bool:
        """Whether the index is the one the newest checkpoint of this run wrote: a failed
        checkpoint at close then undoes nothing (that one holds every delete; the next
        start only reads slot headers past it, as after a crash), so it does not fail the
        close.  Said in a line; checkpoint() counted and logged the failure itself."""
        with self._checkpoint_lock:
            unchanged = self.table.snapshot().version == self._checkpointed_version
        if unchanged:
            log.warning(
                "raw_block: %s: the checkpoint at close was not written, but the newest checkpoint "
                "written holds the same index: no delete is undone (the next start reads the slot "
                "headers past it, as after a crash)",
                self._device.path,
            )
        return unchanged


class CloseCheckpointFailed(Exception):
    """The checkpoint at close was not written: deletes made since the device's newest
    checkpoint come back at the next start."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(
            f"raw_block: {path}: the checkpoint at close was not written ({why}): the next start "
            "recovers from an older checkpoint, and the deletes since it are undone (those keys "
            "come back)"
        )
