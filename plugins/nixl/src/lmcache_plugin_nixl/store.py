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
import threading
from collections.abc import Sequence

import xxhash

from lmcache_plugin_nixl.config import FILE_PATH_FIELD, NixlStoreConfig
from lmcache_plugin_nixl.memory import HostMemory
from lmcache_plugin_nixl.pool import FileSlots, ObjectSlots, SlotStorage, lock_what
from lmcache_plugin_nixl.runtime import NixlRuntime
from lmcache_plugin_nixl.slots import Claim, SlotTable, StoredSlot
from lmcache_plugin_nixl.transfers import BatchTransfer
from lmcache_tiers.plugin import BackendContext, Capacity, ObjectKey, check_directory_free

log = logging.getLogger(__name__)


class NixlStoreBackend:
    """Backend over ``pool_size`` preallocated NIXL storage slots."""

    @staticmethod
    def preflight(config: NixlStoreConfig) -> None:
        """Before L1 exists: a file backend's directory is usable and no other server (or
        adapter) holds it."""
        config.preflight()
        if config.is_file_backend:
            check_directory_free(config.file_path, FILE_PATH_FIELD, what=lock_what(config.file_path))

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
        # Stores and loads using the slot files and the host memory (see _enter_call) and
        # whether close() was called: both are released by close() or, when calls still
        # use them then, by the last of those to leave.  Held only to read or change the two.
        self._use_state = threading.Lock()
        self._users = 0
        self._close_requested = False
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
        if not self._enter_call():
            never_tried = list(range(len(writes)))
            return self._abandon_closing(keys, writes, [False] * len(writes), never_tried, results)
        try:
            return self._write_claimed(keys, payloads, writes, results)
        finally:
            self._leave_call()

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
        if self._close_requested or self._closing():
            return self._abandon_closing(keys, writes, written, stopped, results)
        # A store past this check finishes and publishes its slots even if close() runs
        # meanwhile: the files stay open until it leaves.
        self._finish_and_publish(keys, writes, buffers, written, results)
        return results

    def _enter_call(self) -> bool:
        """Register a store or load as a user of the slot files, before it posts any NIXL
        transfer; False (the call must touch no file) once close() was called.  NIXL posts
        requests by descriptor number, and a request already posted runs on after the call
        was given up: the files are not closed (and their numbers not reused by other
        files), nor the L1 arena deregistered under the request, until every registered
        call left (:meth:`_leave_call`), whether its
        transfers completed, failed or raised.  No lock is held during the call: calls run
        in parallel and close() never waits for one (a transfer or a truncate can hang on
        a hung device)."""
        with self._use_state:
            if self._close_requested:
                return False
            self._users += 1
            return True

    def _leave_call(self) -> None:
        """The last call to leave after close() was called releases the slot files and
        the host memory's registration."""
        with self._use_state:
            self._users -= 1
            release_now = self._close_requested and self._users == 0
        if release_now:
            self._release_storage_safely("the last call using them left")

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
        cut_short = sum(written) + len(stopped)
        if cut_short:
            self.context.count("store_stopped_closing", cut_short)
            log.info(
                "%s: %d keys of a store not stored: the adapter is closing", self.context.name, cut_short
            )
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
            reads = [
                i for i, entry in enumerate(entries) if entry is not None and entry.size == buffers[i].nbytes
            ]
            if not reads:
                return results
            if not self._enter_call():
                self._load_stopped_closing(len(reads))
                return results
            try:
                return self._read_held(keys, buffers, entries, reads, results)
            finally:
                self._leave_call()
        finally:
            self._slots.release_reads(held)

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
            self._load_stopped_closing(len(reads))
            return results
        for i, ok in zip(reads, moved, strict=True):
            entry = entries[i]
            assert entry is not None
            results[i] = ok and self._verified(keys[i], entry, buffers[i])
        return results

    def _load_stopped_closing(self, count: int) -> None:
        """Count and explain the keys of a load that returned once the adapter was closing:
        misses, whatever the transfer did."""
        self.context.count("load_stopped_closing", count)
        self.context.warn("load_closing", "%d keys of a load not loaded: the adapter is closing", count)

    def _verified(self, key: ObjectKey, entry: StoredSlot, loaded: memoryview) -> bool:
        """Whether the bytes read out of ``entry``'s slot are the ones its store wrote.
        Bytes that changed in storage are never handed out: the load of that key fails and
        the key is dropped, so it is not offered again (its slot is freed once no load
        reads it)."""
        if xxhash.xxh3_128_digest(loaded) == entry.digest:
            return True
        if self._slots.drop_damaged(key, entry.slot):
            self.context.count("corrupt_slots_dropped")
        self.context.warn(
            "corrupt_slot",
            "slot %d of %s failed its checksum: the bytes in storage changed since the store; "
            "a miss, and the object is dropped",
            entry.slot,
            key.file_stem(),
        )
        return False

    def _closing(self) -> bool:
        return self.context.closing

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self._slots.delete(keys)

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        return self._slots.items()

    def capacity(self) -> Capacity:
        return Capacity(objects=self._slots.pool_size)

    def stats(self) -> dict[str, int]:
        return {"pool_slots_used": self._slots.used_slots, "pool_slots_total": self._slots.pool_size}

    def close(self) -> None:
        """Refuse further calls and release the slot files and the host memory's NIXL
        registration -- now if no call uses them, else when the last one leaves (one log
        line).  Never waits for a call."""
        # Only the first close decides who releases them (itself, or the last call
        # leaving): a second one, maybe while that call releases them, must not close
        # their descriptor numbers again (another file may reuse one).
        with self._use_state:
            first = not self._close_requested
            self._close_requested = True
            users = self._users
        if not first:
            return
        if users:
            log.warning(
                "%s: %d stores or loads still use the pool's files and the L1 arena: they are "
                "closed, removed and deregistered once the last of them is done",
                self.context.name,
                users,
            )
        else:
            self._release_storage()

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

    def _release_storage_safely(self, why: str) -> None:
        """:meth:`_release_storage` on a call's thread, after close() returned: an error is
        logged (the call's keys are already reported)."""
        try:
            self._release_storage()
        except Exception:
            log.exception("%s: closing the pool's slot files failed", self.context.name)
        else:
            log.info(
                "%s: the pool's slot files are closed and the L1 arena deregistered, %s",
                self.context.name,
                why,
            )
