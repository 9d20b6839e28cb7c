"""``nixl_store``: objects in a pool of storage slots preallocated and registered once.

Core does pinning, byte accounting, serde and the worker threads; this backend maps keys
to slots and moves bytes with batched NIXL transfers.  The pool is the capacity, counted
in objects (``Capacity(objects=pool_size)``): usage is the fraction of slots in use, so
per-adapter L2 eviction starts when the pool fills, core refuses stores of new keys
once every slot is taken (``capacity_refusals``), and deletes (eviction included) return
slots to the pool.  A store that still finds no free slot -- one held by a load of the
object it replaces -- reports its key as not stored (``pool_full_rejections``).

Every slot's XXH3-128 checksum is kept in memory from its store, and a load's bytes are
checked against it before the load reports them: bytes that changed in storage are a
miss, and their key is dropped from the pool (``corrupt_slots_dropped``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import xxhash

from lmcache_plugin_nixl.availability import check_before_l1
from lmcache_plugin_nixl.config import FILE_PATH_FIELD, NixlStoreConfig
from lmcache_plugin_nixl.lifetime import CallLifetime, count_load_stopped_closing, count_store_stopped_closing
from lmcache_plugin_nixl.memory import HostMemory
from lmcache_plugin_nixl.pool import (
    FileSlots,
    ObjectSlots,
    SlotStorage,
    lock_what,
    object_pool_identity,
    object_pool_taken,
)
from lmcache_plugin_nixl.runtime import NixlRuntime
from lmcache_plugin_nixl.slots import Claim, SlotTable, StoredSlot
from lmcache_plugin_nixl.transfers import BatchTransfer
from lmcache_tiers.plugin import BackendContext, Capacity, ObjectKey, check_claimed_once, check_directory_free

log = logging.getLogger(__name__)


class NixlStoreBackend:
    """Backend over ``pool_size`` preallocated NIXL storage slots."""

    @staticmethod
    def preflight(config: NixlStoreConfig) -> None:
        """Before L1 exists: a file backend's directory is usable and no other server (or
        adapter) holds it, and no other adapter of the config keeps its pool in the same
        object backend; the backend's native libraries are there and its remote service
        answers."""
        config.preflight()
        if config.is_file_backend:
            check_directory_free(config.file_path, FILE_PATH_FIELD, what=lock_what(config.file_path))
        else:
            check_claimed_once(
                object_pool_identity(config.backend), "backend", object_pool_taken(config.backend)
            )
        check_before_l1(config.backend, config.nixl_init_params())

    def __init__(self, config: NixlStoreConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        runtime = NixlRuntime.shared()
        runtime.ensure_backend(config.backend, config.nixl_init_params())
        self._host = HostMemory(runtime, config.backend, context.l1_buffer)
        try:
            self._storage: SlotStorage
            if config.is_file_backend:
                self._storage = FileSlots(
                    runtime, config.backend, config.file_path, config.pool_size, config.use_direct_io
                )
            else:
                self._storage = ObjectSlots(runtime, config.backend, config.pool_size)
        except BaseException:
            self._host.close()
            raise
        self._slots = SlotTable(config.pool_size)
        # NIXL posts requests by descriptor number, into the registered arena: the slot
        # files and the host memory's registration outlive every store and load using
        # them, released by close() or by the last call to leave (lifetime.py).
        self._calls = CallLifetime(context, "the pool's slot files and the L1 arena", self._release_storage)
        self._transfer = BatchTransfer(
            runtime, config.backend, self._host, self._storage.storage_mem, direct_io=config.use_direct_io
        )

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        claims = self._slots.claim(keys)
        results = [False] * len(keys)
        writes = [(i, claim) for i, claim in enumerate(claims) if isinstance(claim, int)]
        if len(writes) < len(keys):
            self._explain_unclaimed(claims)
        if not writes:
            return results
        if not self._calls.enter():
            never_tried = list(range(len(writes)))
            return self._abandon_closing(keys, writes, [False] * len(writes), never_tried, results)
        try:
            return self._write_claimed(keys, payloads, writes, results)
        finally:
            self._calls.leave()

    def _write_claimed(
        self,
        keys: Sequence[ObjectKey],
        payloads: Sequence[memoryview],
        writes: list[tuple[int, int]],
        results: list[bool],
    ) -> list[bool]:
        """Write and publish the claimed slots (the caller holds the slot files open)."""
        buffers = [payloads[i] for i, _slot in writes]

        def locate(position: int, address: int) -> tuple[int, int, int]:
            slot = writes[position][1]
            length = buffers[position].nbytes
            return 0, length, self._storage.device(slot, address, length)

        stopped: list[int] = []
        try:
            # Core fails a store still running at its close deadline and hands its payload
            # buffers back before it closes the backend: nothing more is written from them.
            written = self._transfer.run(
                "WRITE", buffers, locate, background=True, stop=self._closing, stopped=stopped
            )
        except BaseException:
            for i, slot in writes:
                self._slots.abandon(keys[i], slot)
            raise
        if self._calls.closed or self._closing():
            return self._abandon_closing(keys, writes, written, stopped, results)
        # A store past this check finishes and publishes its slots even if close() runs
        # meanwhile: the files stay open until it leaves.
        self._finish_and_publish(keys, writes, buffers, written, results)
        return results

    def _finish_and_publish(
        self,
        keys: Sequence[ObjectKey],
        writes: list[tuple[int, int]],
        buffers: list[memoryview],
        written: list[bool],
        results: list[bool],
    ) -> None:
        for position, ((i, slot), ok) in enumerate(zip(writes, written, strict=True)):
            length = buffers[position].nbytes
            if not ok:
                self._explain_failed_write(slot, length)
            if ok:
                try:
                    self._storage.written(slot, length)
                except OSError as exc:
                    # Every claimed slot is published or abandoned, whatever one of them
                    # does: a slot left claimed would refuse its key's stores for good.
                    self.context.count("slot_finish_failures")
                    self.context.warn("slot_finish", "finishing slot %d failed, not stored: %s", slot, exc)
                    ok = False
            if ok:
                # The payload is the caller's until this store returns: its bytes are the
                # ones just written.
                self._slots.publish(keys[i], slot, length, xxhash.xxh3_128_digest(buffers[position]))
                results[i] = True
            else:
                self._slots.abandon(keys[i], slot)

    def _explain_failed_write(self, slot: int, length: int) -> None:
        """NIXL tells only that a write failed; a full filesystem (or quota) is the usual
        cause an operator can act on, so it is told apart, counted and named."""
        cause = self._storage.no_space_for(slot, length)
        if cause is not None:
            self.context.count("store_no_space")
            self.context.warn(
                "no_space",
                "no space left in %s for an object of %d bytes (slot %d), not stored: %s; "
                "stores fail until space returns",
                self.config.file_path,
                length,
                slot,
                cause,
            )

    def _abandon_closing(
        self,
        keys: Sequence[ObjectKey],
        writes: list[tuple[int, int]],
        written: list[bool],
        stopped: list[int],
        results: list[bool],
    ) -> list[bool]:
        """A store that returns once the adapter is closing publishes no slot and finishes
        no slot file (the pool's files close with the adapter; a descriptor number may
        already name another file): its claims are given back and its keys fail (counted
        by core as ``store_keys_failed``).  ``store_stopped_closing`` counts the keys the
        close cost: those written but not published and those never tried -- not those
        whose write the storage failed (logged by the transfer)."""
        for i, slot in writes:
            self._slots.abandon(keys[i], slot)
        count_store_stopped_closing(self.context, sum(written) + len(stopped))
        return results

    def _explain_unclaimed(self, claims: Sequence[int | Claim]) -> None:
        """Count and log the keys a store got no slot for (each reported not stored)."""
        full = sum(1 for claim in claims if claim is Claim.FULL)
        busy = sum(1 for claim in claims if claim is Claim.BUSY)
        if full:
            self.context.count("pool_full_rejections", full)
            self.context.warn(
                "pool_full", "%d keys not stored: no free slot (the rest are stored or still read)", full
            )
        if busy:
            self.context.count("store_busy_skips", busy)
            self.context.warn(
                "store_busy", "%d keys not stored: another store of the same key is still writing it", busy
            )

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        return self._slots.sizes(keys)

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> list[int | None] | None:
        """The slot table is in memory: answered on the caller's thread unless a worker
        holds its lock right now."""
        return self._slots.sizes_now(keys)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        entries = self._slots.acquire_for_read(keys)
        held = [entry.slot for entry in entries if entry is not None]
        results = [False] * len(keys)
        try:
            reads = []
            for i, entry in enumerate(entries):
                if entry is None:
                    continue
                if entry.size != buffers[i].nbytes:
                    self._size_changed(keys[i], entry.size, buffers[i].nbytes)
                    continue
                reads.append(i)
            if not reads:
                return results
            if not self._calls.enter():
                count_load_stopped_closing(self.context, len(reads))
                return results
            try:
                return self._read_held(keys, buffers, entries, reads, results)
            finally:
                self._calls.leave()
        finally:
            self._slots.release_reads(held)

    def _size_changed(self, key: ObjectKey, stored: int, wanted: int) -> None:
        """The key's object is not the size the load's buffer was made for (replaced since
        the lookup by one of another size): a miss, nothing read, the object kept."""
        self.context.count("load_size_changed")
        self.context.warn(
            "size_changed",
            "%s not loaded: it is %d bytes in its slot, the load buffer %d (replaced since the "
            "lookup); a miss, the object kept",
            key.file_stem(),
            stored,
            wanted,
        )

    def _read_held(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        entries: list[StoredSlot | None],
        reads: list[int],
        results: list[bool],
    ) -> list[bool]:
        """Read and verify the slots of ``reads`` (the caller holds the slot files open)."""
        targets = [buffers[i] for i in reads]

        def locate(position: int, address: int) -> tuple[int, int, int]:
            entry = entries[reads[position]]
            assert entry is not None
            length = targets[position].nbytes
            return 0, length, self._storage.device(entry.slot, address, length)

        # Core fails a load still running at its close deadline and hands its buffers
        # to other objects before it closes the backend: nothing more is read into them.
        moved = self._transfer.run("READ", targets, locate, stop=self._closing)
        if self._closing():
            # The buffers may belong to other objects by now (see above): not even
            # read to verify them.
            count_load_stopped_closing(self.context, len(reads))
            return results
        for i, ok in zip(reads, moved, strict=True):
            entry = entries[i]
            assert entry is not None
            if ok:
                results[i] = self._verified(keys[i], entry, buffers[i])
            elif (held := self._storage.held_bytes(entry.slot)) is not None and held < entry.size:
                # A slot file cut short in storage fails every read alike: dropped as
                # damaged, not left to fail each lookup's load for good.
                self._drop_damaged(
                    keys[i], entry, f"holds {held} bytes, shorter than the {entry.size} its store wrote"
                )
        return results

    def _verified(self, key: ObjectKey, entry: StoredSlot, loaded: memoryview) -> bool:
        """Whether the bytes read out of ``entry``'s slot are the ones its store wrote.
        Bytes that changed in storage are never handed out: the load of that key fails and
        the key is dropped, so it is not offered again (its slot is freed once no load
        reads it)."""
        if xxhash.xxh3_128_digest(loaded) == entry.digest:
            return True
        self._drop_damaged(key, entry, "failed its checksum: the bytes in storage changed since the store")
        return False

    def _drop_damaged(self, key: ObjectKey, entry: StoredSlot, why: str) -> None:
        """Drop ``key``, whose slot no longer holds what its store wrote, and release its
        accounting now: a later lookup would take it for a removal behind the adapter's back."""
        accounted = self.context.accounted_size(key)  # before: a store settling since keeps its own
        if self._slots.drop_damaged(key, entry.slot):
            self.context.record_removed(key, accounted)
            self.context.count("corrupt_slots_dropped")
        self.context.warn(
            "corrupt_slot",
            "slot %d of %s %s; a miss, and the object is dropped",
            entry.slot,
            key.file_stem(),
            why,
        )

    def _closing(self) -> bool:
        return self.context.closing

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self._slots.delete(keys)

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        return self._slots.items()

    def capacity(self) -> Capacity:
        return Capacity(objects=self._slots.pool_size)

    def stats(self) -> dict[str, int]:
        return {
            "pool_slots_used": self._slots.used_slots,
            "pool_slots_total": self._slots.pool_size,
            **self._transfer.overdue.stats(),
        }

    def close(self) -> None:
        """Refuse further calls and release the slot files and the host memory's NIXL
        registration -- now if no call uses them, else when the last one leaves (one log
        line).  Never waits for a call."""
        self._calls.close()

    def _release_storage(self) -> None:
        """Deregister and close the slot files, remove them and unlock their directory, and
        deregister the host memory (the L1 arena): a request a call still has running was
        built on both registrations.  Descriptors that failed to close are counted (each
        logged by the storage)."""
        try:
            failures = self._storage.close()
            if failures:
                self.context.count("slot_file_close_failures", failures)
        finally:
            self._host.close()
