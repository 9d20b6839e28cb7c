"""L1 manager: objects in the arena, their states and locks.

Life of an object::

    reserve_write -> WRITING --finish_write--> READY <--reserve_read / finish_read--> READY (locked)
                        |                        |
                  abort_write / write TTL     delete / evict (unlocked only, unless forced);
                        v                     last finish_read of a temporary object
                      freed                      v
                                               freed

"Freed" means the extent goes back to the allocator -- unless someone may still be
reading it (a read-locked object deleted by force, an object whose locks expired a moment
ago), in which case it is quarantined until they are done; every extent that goes back
bumps its generation first, which is how a client holding views into it finds out
(``l1/leases.py``).

One re-entrant lock guards everything, so each batched call is atomic, and listeners
(running inside it) may call back into the manager. Object bytes are copied outside the
lock (the object's own write or read lock protects its extent), so a slow NVMe transfer
never stalls other callers. Listeners are notified once per call,
after the call's state change is complete: an eviction policy that is told about deletes
while its own victim iterator is being consumed would otherwise mutate what it iterates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from lmcache_tiers.errors import ConfigError, L1OutOfMemoryError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.arena import L1Arena
from lmcache_tiers.l1.backing import L1Backing
from lmcache_tiers.l1.leases import ExtentLeases, LeaseStats
from lmcache_tiers.l1.loan import L1Loan
from lmcache_tiers.l1.nvme import DIRECT_IO_ALIGN, NvmeL1File, aligned_buffer
from lmcache_tiers.l1.objects import Eviction, L1Listener, L1Object, L1Stats, ObjectState

if TYPE_CHECKING:
    from typing import Self  # annotations only: Python 3.10 has no typing.Self

__all__ = ["Eviction", "L1Listener", "L1Loan", "L1Manager", "L1Object", "L1Stats", "ObjectState"]

logger = logging.getLogger(__name__)

_Event = Literal["written", "read", "deleted"]
_READY = ObjectState.READY
_WRITING = ObjectState.WRITING


class L1Manager:
    """Objects in one backing (a shared-memory arena, or an NVMe file when ``nvme_path`` is
    set), with write locks, counted read locks and TTLs.

    ``shm_name``, ``prefault`` and ``pin`` concern the memory arena; ``direct_io`` the NVMe
    file. Objects of an NVMe L1 have no memory view: copy with :meth:`read_object` and
    :meth:`write_object`, which work for both backings.

    ``lease_grace_s`` (default: the lock TTL, at most 30 s) is how long the extent of an
    expired lock stays out of reach of new objects after the expiry, and the least time a
    read-locked extent deleted by force is held when its holders do not release it.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        align: int = 4096,
        lock_ttl_s: float = 300.0,
        write_ttl_s: float = 600.0,
        shm_name: str | None = None,
        prefault: bool = True,
        pin: bool = False,
        nvme_path: str | None = None,
        direct_io: bool = True,
        lease_grace_s: float | None = None,
    ) -> None:
        if lock_ttl_s <= 0 or write_ttl_s <= 0:
            raise ConfigError(f"L1 lock TTLs must be positive (lock {lock_ttl_s}s, write {write_ttl_s}s)")
        grace_s = min(lock_ttl_s, 30.0) if lease_grace_s is None else lease_grace_s
        if grace_s < 0:
            raise ConfigError(f"the L1 lease grace period must not be negative, got {grace_s}s")
        try:
            allocator = ExtentAllocator(capacity_bytes, align)
        except ValueError as exc:
            raise ConfigError(f"L1 size: {exc}") from None
        self.lock_ttl_s = lock_ttl_s
        self.write_ttl_s = write_ttl_s
        self._arena: L1Arena | None = None
        self._backing: L1Backing
        if nvme_path is None:
            # One generation per allocation unit: every extent starts on a unit boundary.
            self._arena = L1Arena(
                allocator.capacity, name=shm_name, prefault=prefault, pin=pin, generation_block=align
            )
            self._backing = self._arena
        else:
            if align % DIRECT_IO_ALIGN:
                raise ConfigError(
                    f"an NVMe L1 needs an alignment that is a multiple of {DIRECT_IO_ALIGN}, got {align}"
                )
            self._backing = NvmeL1File(nvme_path, allocator.capacity, direct_io=direct_io)
        self.lock = threading.RLock()  # public so callers can group several calls atomically
        self._allocator = allocator
        self._objects: dict[ObjectKey, L1Object] = {}
        # Locked objects and temporary keys are kept apart so TTL reaping and stats cost
        # O(locked) rather than O(objects).
        self._locked: dict[ObjectKey, L1Object] = {}
        self._temporary: set[ObjectKey] = set()
        self._listeners: list[L1Listener] = []
        # Load reservations freed (forced clear, write TTL) while their load may still be
        # writing into them: their extents stay allocated until the prefetch lets go.
        self._held_loads: set[L1Object] = set()
        self._closed = False
        self._leases = ExtentLeases(allocator, self._arena.generations if self._arena else None, grace_s)

    # -- properties --------------------------------------------------------------------

    @property
    def is_memory(self) -> bool:
        """True if objects live in the shared-memory arena (views, shm clients possible)."""
        return self._arena is not None

    @property
    def arena(self) -> L1Arena:
        """The shared-memory arena; an NVMe L1 has none (check :attr:`is_memory`)."""
        if self._arena is None:
            raise TiersError(f"L1 lives in the NVMe file {self.nvme_file_path}, not in a memory arena")
        return self._arena

    @property
    def nvme_file_path(self) -> str | None:
        """The block file of an NVMe L1; None for the memory arena."""
        return self._backing.path if isinstance(self._backing, NvmeL1File) else None

    @property
    def lease_grace_s(self) -> float:
        """How long an extent is held back after its lock expired (see ``l1/leases.py``)."""
        return self._leases.grace_s

    @property
    def capacity_bytes(self) -> int:
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self._allocator.allocated_bytes

    def usage(self) -> float:
        return self._allocator.allocated_bytes / self._allocator.capacity

    def fragmentation(self) -> float:
        with self.lock:
            return self._allocator.fragmentation()

    def stats(self) -> L1Stats:
        with self.lock:
            write_locked = sum(1 for obj in self._locked.values() if obj.state is _WRITING)
            read_locks = sum(obj.read_locks for obj in self._locked.values())
            return L1Stats(
                objects=len(self._objects),
                used_bytes=self._allocator.allocated_bytes,
                write_locked=write_locked,
                read_locks=read_locks,
                temporary=len(self._temporary),
            )

    def __len__(self) -> int:
        return len(self._objects)

    # -- listeners ---------------------------------------------------------------------

    def add_listener(self, listener: L1Listener) -> None:
        with self.lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: L1Listener) -> None:
        with self.lock:
            self._listeners.remove(listener)

    def _notify(self, event: _Event, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        for listener in list(self._listeners):
            try:
                if event == "written":
                    listener.on_l1_keys_written(keys)
                elif event == "read":
                    listener.on_l1_keys_read(keys)
                else:
                    listener.on_l1_keys_deleted(keys)
            except Exception:
                # L1 state is already consistent; one faulty listener must not fail the
                # caller's request or starve the listeners after it.
                logger.exception("L1 listener %r failed on %s of %d keys", listener, event, len(keys))

    # -- lookups -----------------------------------------------------------------------

    def get(self, key: ObjectKey) -> L1Object | None:
        with self.lock:
            return self._objects.get(key)

    def contains(self, key: ObjectKey) -> bool:
        """True if the key is in L1 in any state (being written or ready)."""
        with self.lock:
            return key in self._objects

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """Number of leading keys that are READY."""
        with self.lock:
            hits = 0
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or obj.state is not _READY:
                    break
                hits += 1
            return hits

    def view(self, obj: L1Object) -> memoryview:
        """The object's bytes in the arena. Raises KeyError if the object has left L1,
        because its extent may already belong to another object, and TiersError for an
        NVMe L1, whose objects are reachable only through read_object/write_object."""
        with self.lock:
            self._check_present(obj)
            if self._arena is None:
                raise TiersError(
                    f"L1 objects in the NVMe file {self.nvme_file_path} have no memory view: "
                    "copy them with read_object/write_object"
                )
            return self._arena.buffer[obj.offset : obj.offset + obj.size]

    def read_object(self, obj: L1Object, out: memoryview) -> None:
        """Copy the object's bytes into ``out[:obj.size]``, from either backing.

        The caller holds a lock on the object (a read lock, or the write lock it is
        filling under), so its extent cannot change hands during the copy -- a forced
        delete meanwhile quarantines the extent. Raises KeyError if the object has left L1
        and its extent is not held for its readers.
        """
        out = _byte_view(out)
        if out.nbytes < obj.size:
            raise ValueError(f"a {out.nbytes}-byte buffer cannot hold {obj.key} ({obj.size} bytes)")
        with self.lock:
            if not self._leases.holds(obj):
                self._check_present(obj)
        self._backing.read_into(obj.offset, obj.size, out)

    def write_object(self, obj: L1Object, data: memoryview) -> None:
        """Fill an object that is being written with exactly ``obj.size`` bytes.

        Only WRITING objects are accepted: a READY object may have readers, who must see
        the bytes that were committed. Raises KeyError if the object has left L1.
        """
        data = _byte_view(data)
        if data.nbytes != obj.size:
            raise ValueError(f"{obj.key} holds {obj.size} bytes, got {data.nbytes}")
        with self.lock:
            self._check_present(obj)
            if obj.state is not _WRITING:
                raise ValueError(f"{obj.key} is {obj.state.value}, not being written")
        self._backing.write_from(obj.offset, data)

    # -- writing -----------------------------------------------------------------------

    def reserve_write(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        *,
        temporary: bool = False,
        layouts: Sequence[str] | None = None,
    ) -> dict[ObjectKey, L1Object]:
        """Allocate and write-lock the keys not yet in L1, all or nothing.

        Keys already present (in any state, or earlier in the same batch) are skipped and
        absent from the result. Raises L1OutOfMemoryError, with nothing reserved, when the
        new keys do not fit; the caller evicts and retries. ``layouts`` (validated by the
        caller) are kept with the objects for the L2 serde chain.
        """
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if layouts is not None and len(layouts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")
        with self.lock:
            self._check_open()
            wanted: dict[ObjectKey, int] = {}
            wanted_layouts: dict[ObjectKey, str] = {}
            for position, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if key not in self._objects and key not in wanted:
                    wanted[key] = size
                    if layouts is not None and layouts[position]:
                        wanted_layouts[key] = layouts[position]
            if not wanted:
                return {}
            offsets = self._allocator.allocate_many(list(wanted.values()))
            if offsets is None and self._leases.reclaim(time.monotonic()):
                offsets = self._allocator.allocate_many(list(wanted.values()))
            if offsets is None:
                allocator = self._allocator
                need = sum(allocator.extent_size(size) for size in wanted.values())
                raise L1OutOfMemoryError(
                    f"L1 cannot hold {len(wanted)} new objects ({need} bytes): {allocator.free_bytes} of "
                    f"{allocator.capacity} bytes free, largest free extent {allocator.largest_free_extent()}"
                )
            deadline = time.monotonic() + self.write_ttl_s
            reserved: dict[ObjectKey, L1Object] = {}
            for (key, size), offset in zip(wanted.items(), offsets, strict=True):
                obj = L1Object(
                    key, offset, size, temporary, _WRITING, 0, deadline, wanted_layouts.get(key, "")
                )
                self._objects[key] = obj
                self._locked[key] = obj
                if temporary:
                    self._temporary.add(key)
                reserved[key] = obj
            return reserved

    def finish_write(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """WRITING -> READY; False for keys that are not being written."""
        return self._finish_write(keys, 0)

    def finish_write_and_reserve_read(self, keys: Sequence[ObjectKey], count: int = 1) -> list[bool]:
        """WRITING -> READY and read-locked ``count`` times in one step, so a prefetched
        object cannot be evicted between being loaded and being handed to its reader."""
        _check_count(count)
        return self._finish_write(keys, count)

    def _finish_write(self, keys: Sequence[ObjectKey], read_count: int) -> list[bool]:
        with self.lock:
            self._check_open()
            # A reservation made by a prefetch is finished by that prefetch only (finish_load).
            return self._make_ready([self._objects.get(key) for key in keys], read_count, loads=False)

    def _make_ready(self, objs: Sequence[L1Object | None], read_count: int, *, loads: bool) -> list[bool]:
        """WRITING -> READY, read-locked ``read_count`` times; None and reservations of the
        other kind (a prefetch's when not ``loads``, a writer's when ``loads``) are refused.
        The caller holds the lock."""
        done: list[bool] = []
        written: list[ObjectKey] = []
        deadline = time.monotonic() + self.lock_ttl_s
        for obj in objs:
            if obj is None or obj.state is not _WRITING or obj.loading is not loads:
                done.append(False)
                continue
            obj.loading = False
            obj.state = _READY
            obj.read_locks = read_count
            if read_count:
                obj.lock_deadline = deadline
            else:
                del self._locked[obj.key]
            written.append(obj.key)
            done.append(True)
        self._notify("written", written)
        return done

    def abort_write(self, keys: Sequence[ObjectKey]) -> None:
        """Free objects still being written; other keys are left alone."""
        with self.lock:
            aborted: list[L1Object] = []
            for key in dict.fromkeys(keys):
                obj = self._objects.get(key)
                if obj is not None and obj.state is _WRITING and not obj.loading:
                    aborted.append(obj)
            self._free(aborted)

    # -- reading -----------------------------------------------------------------------

    def reserve_read(self, keys: Sequence[ObjectKey], count: int = 1) -> dict[ObjectKey, L1Object]:
        """Read-lock ``count`` times every READY key present (not only a prefix).

        A key repeated in the batch is locked once; pass the same keys to finish_read.
        """
        _check_count(count)
        with self.lock:
            self._check_open()
            hits: dict[ObjectKey, L1Object] = {}
            deadline = time.monotonic() + self.lock_ttl_s
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or obj.state is not _READY or key in hits:
                    continue
                obj.read_locks += count
                # One deadline per object: a new reader extends it, and reaping drops all
                # of the object's read locks at once.
                obj.lock_deadline = max(obj.lock_deadline, deadline) if key in self._locked else deadline
                self._locked[key] = obj
                hits[key] = obj
            self._notify("read", list(hits))
            return hits

    def reserve_read_prefix(self, keys: Sequence[ObjectKey], count: int = 1) -> list[L1Object]:
        """Read-lock ``count`` times the leading READY keys; returns their objects in order.

        The same as ``reserve_read(keys[:prefix_hits(keys)], count)`` under one lock, in
        one pass: every LOOKUP and RETRIEVE does this, so it is worth a method. A key
        repeated in the prefix is locked once and listed at each of its positions.
        """
        if count < 1:
            _check_count(count)  # raises
        with self.lock:
            # No open check: a closed manager holds no objects, so nothing is locked.
            objects = self._objects
            prefix: list[L1Object] = []
            for key in keys:
                obj = objects.get(key)
                if obj is None or obj.state is not _READY:
                    break
                prefix.append(obj)
            if not prefix:
                return prefix
            # Deduplicated by object identity (a cheap hash, in C) rather than by key.
            unique = list(dict.fromkeys(prefix))
            locked = self._locked
            deadline = time.monotonic() + self.lock_ttl_s
            for obj in unique:
                # A READY object is in _locked exactly when it has read locks.
                if obj.read_locks:
                    if obj.lock_deadline < deadline:
                        obj.lock_deadline = deadline
                else:
                    locked[obj.key] = obj
                    obj.lock_deadline = deadline
                obj.read_locks += count
            self._notify("read", [obj.key for obj in unique])
            return prefix

    def finish_read(self, keys: Sequence[ObjectKey], count: int = 1) -> None:
        """Drop ``count`` read locks per key; a temporary object left unlocked is freed.

        Locks on an extent quarantined by a forced delete are credited first (see
        ``l1/leases.py``); keys not in L1 or not read-locked (e.g. their locks expired)
        are ignored.
        """
        _check_count(count)
        with self.lock:
            freed: list[L1Object] = []
            leases = self._leases
            for key in dict.fromkeys(keys):
                left = leases.credit(key, count) if leases.has_holders(key) else count
                obj = self._objects.get(key)
                if obj is None or obj.read_locks == 0 or not left:
                    continue
                obj.read_locks = max(0, obj.read_locks - left)
                if obj.read_locks == 0:
                    del self._locked[key]
                    if obj.temporary:
                        freed.append(obj)
            self._free(freed)

    def set_temporary(self, keys: Sequence[ObjectKey], temporary: bool) -> None:
        """Mark objects to be freed after their last read (or not).

        Marking an unlocked object temporary does not free it now: it is freed when a read
        lock on it is next released, or by eviction.
        """
        with self.lock:
            for key in keys:
                obj = self._objects.get(key)
                if obj is None:
                    continue
                obj.temporary = temporary
                if temporary:
                    self._temporary.add(key)
                else:
                    self._temporary.discard(key)

    # -- hand-offs with L2: writes waiting for their store, loads, loans ---------------

    def mark_unstored(self, keys: Sequence[ObjectKey]) -> list[L1Object]:
        """Flag READY objects as committed but not yet stored in L2, so that eviction takes
        them last; returns the flagged objects, to be passed to ``settle_unstored`` once
        their stores are done (stored, failed or not wanted)."""
        with self.lock:
            marked: list[L1Object] = []
            for key in keys:
                obj = self._objects.get(key)
                if obj is not None and obj.state is _READY:
                    obj.unstored = True
                    marked.append(obj)
            return marked

    def settle_unstored(self, objs: Iterable[L1Object]) -> None:
        """Clear ``mark_unstored``'s flag on exactly these objects (ones already gone from L1
        are harmless: the flag dies with them)."""
        with self.lock:
            for obj in objs:
                obj.unstored = False

    def reserve_load(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], *, temporary: bool
    ) -> dict[ObjectKey, L1Object]:
        """``reserve_write`` for a prefetch that fills the objects from L2.

        Such a reservation is finished (``finish_load``) or freed (``abort_load``) only by
        the prefetch, by object identity: a writer's commit or abort of the same key never
        publishes or frees it, so bytes whose load failed can never become readable or be
        queued for L2 as if freshly written.
        """
        with self.lock:
            reserved = self.reserve_write(keys, sizes, temporary=temporary)
            for obj in reserved.values():
                obj.loading = True
            return reserved

    def finish_load(self, objs: Sequence[L1Object], count: int = 1) -> list[bool]:
        """Loaded objects of ``reserve_load``: READY and read-locked ``count`` times in one
        step, so nothing can evict them before the reader gets them.  False for an object
        that is no longer this reservation (freed by a forced clear or its TTL)."""
        _check_count(count)
        with self.lock:
            self._check_open()
            objects = self._objects
            current = [obj if objects.get(obj.key) is obj else None for obj in objs]
            return self._make_ready(current, count, loads=True)

    def abort_load(self, objs: Iterable[L1Object]) -> None:
        """Free ``reserve_load`` objects that will not be finished (failed, or not needed),
        once their load is over; objects finished meanwhile are left alone.  An object a
        forced clear or its TTL already took out of L1 gives its held extent back now."""
        with self.lock:
            objects = self._objects
            present: list[L1Object] = []
            held: list[L1Object] = []
            for obj in dict.fromkeys(objs):
                if obj in self._held_loads:
                    self._held_loads.discard(obj)
                    held.append(obj)
                elif objects.get(obj.key) is obj and obj.state is _WRITING and obj.loading:
                    present.append(obj)
                else:
                    continue
                obj.loading = False
            self._release_extents(held)  # detached, and reported deleted, already
            self._free(present)

    def lend(self, obj: L1Object, *, fill: bool = False) -> L1Loan:
        """Lend the object's bytes to a caller that holds a lock on it.

        For reading (the default), ``buffer`` holds the bytes: the object's extent in the
        arena (read-only), or a host copy staged from the NVMe file.  With ``fill`` the
        object must be WRITING: the caller writes ``buffer`` -- the extent itself, or a
        staging buffer -- and calls ``commit()`` to make those the object's bytes.  Raises
        KeyError if the object has left L1.
        """
        with self.lock:
            self._check_present(obj)
            if fill and obj.state is not _WRITING:
                raise ValueError(f"{obj.key} is {obj.state.value}, not being written")
        if self._arena is not None:
            extent = self._arena.buffer[obj.offset : obj.offset + obj.size]
            return L1Loan(extent if fill else extent.toreadonly(), staged=False)
        staged = aligned_buffer(obj.size)  # page-aligned: O_DIRECT moves it without a bounce
        if fill:
            return L1Loan(staged, staged=True, commit=lambda: self.write_object(obj, staged))
        self._backing.read_into(obj.offset, obj.size, staged)
        return L1Loan(staged, staged=True)

    # -- removal -----------------------------------------------------------------------

    def delete(self, keys: Sequence[ObjectKey], *, force: bool = False) -> list[bool]:
        """Free objects; read-locked ones are skipped unless ``force``, objects being
        written always (only abort_write or the write TTL ends a reservation, whose writer
        may be copying into it).  A read-locked object deleted by force leaves L1 at once;
        its extent is held until its readers release it or their lease ends."""
        with self.lock:
            done: list[bool] = []
            victims: list[L1Object] = []
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or obj.state is _WRITING or (obj.read_locks and not force):
                    done.append(False)
                    continue
                self._detach(obj)
                victims.append(obj)
                done.append(True)
            self._release_extents(victims)
            self._notify("deleted", [obj.key for obj in victims])
            return done

    def evict(self, bytes_to_free: int, victims: Iterable[ObjectKey]) -> list[ObjectKey]:
        """Delete unlocked READY victims, in the given order, until ``bytes_to_free`` aligned
        bytes are freed or the victims run out. Returns the evicted keys (see make_room)."""
        return self.make_room(bytes_to_free, victims).keys

    def make_room(
        self, bytes_to_free: int, victims: Iterable[ObjectKey], *, spare_unstored: bool = False
    ) -> Eviction:
        """Delete unlocked READY victims, in the given order, until ``bytes_to_free`` aligned
        bytes are freed or the victims run out.

        Objects still waiting for their L2 store (``mark_unstored``) are passed over while
        the others can free the room: losing one loses an acknowledged write.  Only when
        every other victim is not enough are they evicted, in victim order, and reported in
        ``Eviction.unstored``; with ``spare_unstored`` never.
        """
        evicted: list[L1Object] = []
        unstored: list[L1Object] = []
        if bytes_to_free <= 0:
            return Eviction([], [])
        with self.lock:
            freed = 0
            passed_over: dict[L1Object, None] = {}
            try:
                for key in victims:
                    obj = self._objects.get(key)
                    if obj is None or obj.state is not _READY or obj.read_locks:
                        continue
                    if obj.unstored:
                        passed_over[obj] = None
                        continue
                    self._detach(obj)
                    evicted.append(obj)
                    freed += self._allocator.size_at(obj.offset)
                    if freed >= bytes_to_free:
                        break
                if freed < bytes_to_free and not spare_unstored:
                    # Every victim was seen and the room is still short: the last resort.
                    for obj in passed_over:
                        self._detach(obj)
                        evicted.append(obj)
                        unstored.append(obj)
                        freed += self._allocator.size_at(obj.offset)
                        if freed >= bytes_to_free:
                            break
            finally:
                # The victims iterator may belong to a listener (the eviction policy), so it
                # is told only once iteration is over; detached objects are freed even if
                # the iterator raised.
                self._release_extents(evicted)
                self._notify("deleted", [obj.key for obj in evicted])
            return Eviction([obj.key for obj in evicted], [obj.key for obj in unstored])

    def expire_locks(self, now: float | None = None) -> int:
        """Reap locks past their TTL, as if their crashed holders had released them.

        An expired write reservation is freed; expired read locks are dropped (and a
        temporary object with them). Either way the extent is not reused for the lease
        grace period, in case its holder is only slow; quarantined extents whose lease has
        ended are reclaimed. Returns the number of objects whose locks expired. ``now`` is
        a ``time.monotonic()`` value.
        """
        now = time.monotonic() if now is None else now
        with self.lock:
            expired_writes: list[L1Object] = []
            freed: list[L1Object] = []
            expired_reads = 0
            for key, obj in list(self._locked.items()):
                if obj.lock_deadline > now:
                    continue
                self._leases.lapse(obj, now)
                if obj.state is _WRITING:
                    expired_writes.append(obj)
                    continue
                expired_reads += 1
                obj.read_locks = 0
                del self._locked[key]
                if obj.temporary:
                    freed.append(obj)
            if expired_writes or expired_reads:
                logger.warning(
                    "L1 lock TTL expired: %d write reservations freed, %d objects' read locks dropped; "
                    "their extents are not reused for another %gs",
                    len(expired_writes),
                    expired_reads,
                    self._leases.grace_s,
                )
            self._free(expired_writes + freed)
            self._leases.reclaim(now)
            return len(expired_writes) + expired_reads

    def clear(self, *, force: bool = False) -> int:
        """Delete every object (unlocked ones only unless ``force``); returns how many."""
        with self.lock:
            return sum(self.delete(list(self._objects), force=force))

    def close(self) -> None:
        """Drop every object without notifying listeners and release the arena. Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self._objects.clear()
            self._locked.clear()
            self._temporary.clear()
            self._listeners.clear()
            self._leases.close()
            self._backing.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the L1 manager is closed")

    def _check_present(self, obj: L1Object) -> None:
        self._check_open()
        if self._objects.get(obj.key) is not obj:
            raise KeyError(f"{obj.key} is no longer in L1")

    def _detach(self, obj: L1Object) -> None:
        del self._objects[obj.key]
        self._locked.pop(obj.key, None)
        self._temporary.discard(obj.key)

    def _release_extents(self, objs: list[L1Object]) -> None:
        if not objs:
            return
        # An adapter may still be filling a load reservation: handing its extent to another
        # object would let the load overwrite that object's bytes.  abort_load frees it.
        free = [obj for obj in objs if not obj.loading]
        if len(free) < len(objs):
            self._held_loads.update(obj for obj in objs if obj.loading)
        if free:
            self._leases.release_extents(free, time.monotonic())

    # -- leases ------------------------------------------------------------------------

    def generations(self, objs: Sequence[L1Object]) -> list[int]:
        """The generation of each object's extent now (0s for an NVMe L1): a reader that
        finds the same value in the arena's table after copying read the object's bytes."""
        return self._leases.generations(objs)

    def lease_stats(self) -> LeaseStats:
        with self.lock:
            return self._leases.stats()

    def reclaimable_bytes(self) -> int:
        """Free bytes plus what evicting every unlocked object would free: the most any
        reservation can get, whatever the eviction policy picks."""
        with self.lock:
            size_at = self._allocator.size_at
            locked = sum(size_at(obj.offset) for obj in self._locked.values())
            return self._allocator.capacity - locked - self._leases.quarantined_bytes

    def _free(self, objs: list[L1Object]) -> None:
        for obj in objs:
            self._detach(obj)
        self._release_extents(objs)
        self._notify("deleted", [obj.key for obj in objs])


def _byte_view(buffer: memoryview) -> memoryview:
    """``buffer`` as a flat view of unsigned bytes, the only shape slice assignment mixes."""
    view = memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def _check_count(count: int) -> None:
    if count < 1:
        raise ValueError(f"lock count must be at least 1, got {count}")
