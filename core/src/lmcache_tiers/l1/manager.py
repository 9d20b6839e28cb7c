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

Every lock expires at its own deadline (its TTL from when it was taken), whatever locks
are taken on the object since: a holder that forgets a lock at its TTL without releasing
it (a crashed client, or one whose late release could drop a lock taken since) leaves
nothing behind once ``expire_locks`` has run.  A release does not say which lock it drops:
L1 drops the one expiring first from the caller's ``not_before`` on (without it: after now),
which never leaves a live holder without a lock lasting until its own deadline
(``l1/reads.py``).  Deadlines are rounded up to a grid of a 64th of the lock TTL
(``lock_deadline``), so however often an object is locked it keeps a count per deadline
for at most 65 live ones, and a lock is reaped up to a 64th of its TTL late.

One re-entrant lock guards everything, so each batched call is atomic (but ``clear``,
which lets go of it between batches: ``l1/removal.py``), and listeners
(running inside it) may call back into the manager. Object bytes are copied outside the
lock (the object's own write or read lock protects its extent), so a slow NVMe transfer
never stalls other callers. Listeners are notified once per call, after the call's state
change is complete: an eviction policy that is told about deletes while its own victim
iterator is being consumed would otherwise mutate what it iterates.

The manager is the public face of parts sharing its lock and object table (``l1/table.py``):
write reservations (``writes.py``), read locks (``reads.py``), hand-offs with L2
(``handoffs.py``), deletes, eviction and TTL reaping (``removal.py``), bytes (``access.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.access import ObjectBytes
from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.arena import L1Arena
from lmcache_tiers.l1.backing import open_backing
from lmcache_tiers.l1.handoffs import L2Handoffs
from lmcache_tiers.l1.leases import ExtentLeases, LeaseStats
from lmcache_tiers.l1.loan import L1Loan
from lmcache_tiers.l1.nvme import NvmeL1File
from lmcache_tiers.l1.objects import Eviction, L1Listener, L1Object, L1Stats, ObjectState
from lmcache_tiers.l1.reads import LOCK_GRID_STEPS, ReadLocks
from lmcache_tiers.l1.removal import REAP_BATCH, Removal
from lmcache_tiers.l1.table import L1Listeners, ObjectTable, check_lock_count
from lmcache_tiers.l1.writes import SkippedWrites, WriteReservations
from lmcache_tiers.tmpfs import SHM_DIR

if TYPE_CHECKING:
    from typing import Self  # annotations only: Python 3.10 has no typing.Self

_OFFSET = attrgetter("offset")
_HELD_OFFSET = attrgetter("obj.offset")
_EXTENT_BYTES = attrgetter("extent_bytes")

__all__ = ["Eviction", "L1Listener", "L1Loan", "L1Manager", "L1Object", "L1Stats", "ObjectState"]


class L1Manager:
    """Objects in one backing (a shared-memory arena, or an NVMe file when ``nvme_path`` is
    set), with write locks, counted read locks and TTLs.

    ``shm_name``, ``shm_dir``, ``prefault`` and ``pin`` concern the memory arena; ``direct_io`` the NVMe
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
        shm_dir: str = SHM_DIR,
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
        self._backing, self._arena = open_backing(
            allocator.capacity,
            align,
            shm_name=shm_name,
            shm_dir=shm_dir,
            prefault=prefault,
            pin=pin,
            nvme_path=nvme_path,
            direct_io=direct_io,
        )
        self.lock = threading.RLock()  # public so callers can group several calls atomically
        self._allocator = allocator
        self._leases = ExtentLeases(allocator, self._arena.generations if self._arena else None, grace_s)
        self._table = ObjectTable(self._leases, L1Listeners())
        lock, table, leases = self.lock, self._table, self._leases
        self._skipped = SkippedWrites()
        self._writes = WriteReservations(
            lock, table, allocator, leases, self._skipped, lock_ttl_s=lock_ttl_s, write_ttl_s=write_ttl_s
        )
        self._reads = ReadLocks(lock, table, leases, lock_ttl_s=lock_ttl_s)
        self._handoffs = L2Handoffs(lock, table, self._writes)
        self._removal = Removal(lock, table, allocator, leases, self._skipped)
        self._bytes = ObjectBytes(lock, table, leases, self._backing, self._arena, self.nvme_file_path)

    @property
    def lock_ttl_s(self) -> float:
        """How long read locks (and a read-locked hand-off) last unless released."""
        return self._reads.lock_ttl_s

    @property
    def lock_grid_s(self) -> float:
        """The step read-lock deadlines are rounded up to (``lock_deadline``)."""
        return self._reads.lock_ttl_s / LOCK_GRID_STEPS

    def lock_deadline(self, now: float) -> float:
        """When a read lock taken at ``now`` (a ``time.monotonic()`` value) expires: the lock
        TTL later, rounded up to a multiple of ``lock_grid_s``.  Monotonic in ``now``: a
        holder that reads the clock before taking its lock never thinks it lasts longer
        than L1 keeps it.  The very float ``read_lock_deadline`` gives, taken from the span
        of times lookups keep (``ReadLocks.lock_deadline``): a front end asks for every
        LOOKUP it answers, and rounding afresh cost it ~0.3 us each time."""
        return self._reads.lock_deadline(now)

    @property
    def write_ttl_s(self) -> float:
        """How long a write reservation lasts unless finished or aborted."""
        return self._writes.write_ttl_s

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
            return self._table.stats(self._allocator.allocated_bytes)

    def __len__(self) -> int:
        return len(self._table.objects)

    def add_listener(self, listener: L1Listener) -> None:
        with self.lock:
            self._table.listeners.add(listener)

    def remove_listener(self, listener: L1Listener) -> None:
        with self.lock:
            self._table.listeners.remove(listener)

    def get(self, key: ObjectKey) -> L1Object | None:
        with self.lock:
            return self._table.objects.get(key)

    def unstored(self) -> list[L1Object]:
        """Objects whose L2 stores are not settled yet: L1 holds their only copy."""
        with self.lock:
            return [obj for obj in self._table.ready.values() if obj.unstored]

    @property
    def unstored_bytes(self) -> int:
        """Bytes of the objects L1 holds flagged unstored (``mark_unstored``): acknowledged
        writes stored in no L2 adapter yet, the ones an eviction would lose.  O(1), read
        without the lock (a figure for pacing, a moment old at worst)."""
        return self._table.unstored_bytes

    def contains(self, key: ObjectKey) -> bool:
        """True if the key is in L1 in any state (being written or ready)."""
        with self.lock:
            return key in self._table.objects

    def count_being_written(self, keys: AbstractSet[ObjectKey]) -> int:
        """How many of ``keys`` are WRITING (a writer holds their reservation): what a
        front end tells apart from keys already stored when it counts a store's skips."""
        with self.lock:
            table = self._table
            if len(table.objects) == len(table.ready) or keys <= table.ready.keys():
                # No writer holds a reservation, or none of these keys' (a store of keys L1
                # has, the usual skip): a membership walk in C that builds no set.
                return 0
            # The WRITING objects are those not READY: two set intersections, run in C
            # over the smaller side, not a Python loop per key -- a store of many chunks
            # L1 already has asks about every one of them, on the request's hot path.
            return len(table.objects.keys() & keys) - len(table.ready.keys() & keys)

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        """Number of leading keys that are READY."""
        return self._reads.prefix_hits(keys)

    def view(self, obj: L1Object) -> memoryview:
        """The object's bytes in the arena. Raises KeyError if the object has left L1,
        because its extent may already belong to another object, and TiersError for an
        NVMe L1, whose objects are reachable only through read_object/write_object."""
        return self._bytes.view(obj)

    def read_object(self, obj: L1Object, out: memoryview) -> None:
        """Copy the object's bytes into ``out[:obj.size]``, from either backing.

        The caller holds a lock on the object (a read lock, or the write lock it is
        filling under), so its extent cannot change hands during the copy -- a forced
        delete meanwhile quarantines the extent. Raises KeyError if the object has left L1
        and its extent is not held for its readers.
        """
        self._bytes.read_object(obj, out)

    def write_object(self, obj: L1Object, data: memoryview) -> None:
        """Fill an object that is being written with exactly ``obj.size`` bytes.

        Only WRITING objects are accepted: a READY object may have readers, who must see
        the bytes that were committed. Raises KeyError if the object has left L1.
        """
        self._bytes.write_object(obj, data)

    def lend(self, obj: L1Object, *, fill: bool = False) -> L1Loan:
        """Lend the object's bytes to a caller that holds a lock on it.

        For reading (the default), ``buffer`` holds the bytes: the object's extent in the
        arena (read-only), or a host copy staged from the NVMe file.  With ``fill`` the
        object must be WRITING: the caller writes ``buffer`` -- the extent itself, or a
        staging buffer -- and calls ``commit()`` to make those the object's bytes.  Raises
        KeyError if the object has left L1 (for reading: and its extent is not held for
        its lock holders, as a forced delete holds it).
        """
        return self._bytes.lend(obj, fill=fill)

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

        Keys already present (READY, being written by another writer, or earlier in the
        same batch) are skipped and absent from the result; a key a prefetch is loading is
        taken from that load and reserved (``l1/writes.py``). Raises L1OutOfMemoryError,
        with nothing reserved, when the new keys do not fit; the caller evicts and retries.
        ``layouts`` (validated by the caller) are kept with the objects for the L2 serde chain.
        """
        return self._writes.reserve(keys, sizes, temporary=temporary, layouts=layouts)

    def finish_write(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """WRITING -> READY; False for keys that are not being written."""
        return self._writes.finish(keys, 0)

    def finish_reserved(self, reserved: Mapping[ObjectKey, L1Object]) -> list[L1Object]:
        """``finish_write`` of the reservations ``reserve_write`` returned that are still
        the objects of their keys, in one pass; returns the objects made READY.  A
        reservation L1 reaped at the write TTL may be another writer's by now, whose bytes
        are not there yet: it is left alone."""
        return self._writes.finish_reserved(reserved)

    def finish_write_and_reserve_read(self, keys: Sequence[ObjectKey], count: int = 1) -> list[bool]:
        """WRITING -> READY and read-locked ``count`` times in one step, so a prefetched
        object cannot be evicted between being loaded and being handed to its reader."""
        check_lock_count(count)
        return self._writes.finish(keys, count)

    def abort_write(self, keys: Sequence[ObjectKey]) -> None:
        """Free objects still being written; other keys are left alone."""
        self._writes.abort(keys)

    def fence_writers(self, objs: Sequence[L1Object]) -> list[L1Object]:
        """Mark reservations ``reserve_write`` returned as copied into by their writer
        itself, through the shared arena: if one expires, its extent is fenced (never
        reused) until :meth:`writers_done` names it (``l1/leases.py``).  Returns those
        that are no longer being written (reaped already): not fenced, their writer must
        not be handed them."""
        with self.lock:
            get = self._table.objects.get
            gone: list[L1Object] = []
            for obj in objs:
                if get(obj.key) is obj and obj.state is ObjectState.WRITING:
                    obj.fenced = True
                else:
                    gone.append(obj)
            return gone

    def writers_done(self, objs: Sequence[L1Object]) -> int:
        """The writers of these reservations (fenced by :meth:`fence_writers`) have stopped
        copying into them: those still being written expire as any reservation does, and
        the extents of those that expired go back now.  Returns how many went back."""
        with self.lock:
            for obj in objs:
                obj.fenced = False
            return self._leases.writers_done(objs)

    # -- reading -----------------------------------------------------------------------

    def reserve_read(self, keys: Sequence[ObjectKey], count: int = 1) -> dict[ObjectKey, L1Object]:
        """Read-lock ``count`` times every READY key present (not only a prefix).

        A key repeated in the batch is locked once; pass the same keys to finish_read.
        """
        return self._reads.lock_present(keys, count)

    def reserve_read_prefix(
        self,
        keys: Sequence[ObjectKey],
        count: int = 1,
        *,
        until_repeat: bool = False,
        generations: list[int] | None = None,
    ) -> list[L1Object]:
        """Read-lock ``count`` times the leading READY keys; returns their objects in order.

        The same as ``reserve_read(keys[:prefix_hits(keys)], count)`` under one lock, in
        one pass: every LOOKUP and RETRIEVE does this, so it is worth a method. A key
        repeated in the prefix is locked once and listed at each of its positions; with
        ``until_repeat`` the prefix ends before its first repeated key instead.

        ``generations``, when given, is extended with the generation of each returned
        object's extent (see :meth:`generations`), read in the same hold of the lock that
        took the locks: what a reader of the extents in the shared arena is handed.  Read
        after the call it may already be a later one: a read lock keeps an extent from
        going back to the allocator only while the object stays in L1, and once a forced
        delete quarantined it, releases of its key (by anyone) are credited to it.
        """
        return self._reads.lock_prefix(keys, count, until_repeat=until_repeat, generations=generations)

    def reserve_store(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, L1Object]:
        """Read-lock once every READY key present for an L2 store task, which reads the
        objects' extents until it reports.

        Unlike a reader's, these locks are not reaped at the lock TTL (an adapter stalled
        that long still copies from the extent when it wakes), and an object deleted by
        force meanwhile keeps its extent until :meth:`finish_store`: the extent never holds
        another object's bytes while a store may write them to L2 under this key.
        """
        return self._reads.lock_for_store(keys)

    def finish_store(self, objs: Iterable[L1Object]) -> None:
        """The store task that ``reserve_store`` locked ``objs`` for has reported (or was
        given up): drop its lock on each, and free extents held for it."""
        self._reads.release_store(objs)

    def finish_read(
        self, keys: Sequence[ObjectKey], count: int = 1, *, not_before: float | None = None
    ) -> None:
        """Drop ``count`` read locks per key; a temporary object left unlocked is freed.

        Locks on an extent quarantined by a forced delete are credited first (see
        ``l1/leases.py``); keys not in L1 or not read-locked (e.g. their locks expired)
        are ignored.  Each lock keeps its own deadline, but a release does not say which
        lock it drops: the one dropped is the one expiring first after now or, given
        ``not_before`` (a monotonic time no later than the released locks' deadlines:
        ``lock_deadline`` of a time read before the caller took them), not before it.  So
        no holder's lock is ever reaped before its deadline, and a caller that gives ``not_before`` never
        takes the place of a lock whose holder forgot it (which then goes at its deadline,
        however often the key is locked since).
        """
        self._reads.release(keys, count, not_before)

    def set_temporary(self, keys: Sequence[ObjectKey], temporary: bool) -> None:
        """Mark objects to be freed after their last read (or not).

        Marking an unlocked object temporary does not free it now: it is freed when a read
        lock on it is next released, or by eviction.
        """
        self._reads.set_temporary(keys, temporary)

    # -- hand-offs with L2: writes waiting for their store, loads ----------------------

    def mark_unstored(self, keys: Sequence[ObjectKey]) -> list[L1Object]:
        """Flag READY objects as committed but not yet stored in L2, so that eviction takes
        them last; returns the flagged objects, to be passed to ``settle_unstored`` once
        their stores are done (stored, failed or not wanted)."""
        return self._handoffs.mark_unstored(keys)

    def settle_unstored(self, objs: Iterable[L1Object]) -> None:
        """Clear ``mark_unstored``'s flag on exactly these objects (ones already gone from L1
        are harmless: the flag dies with them)."""
        self._handoffs.settle_unstored(objs)

    def reserve_load(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], *, temporary: bool
    ) -> dict[ObjectKey, L1Object]:
        """``reserve_write`` for a prefetch that fills the objects from L2.

        Such a reservation is finished (``finish_load``) or freed (``abort_load``) only by
        the prefetch, by object identity: a writer's commit or abort of the same key never
        publishes or frees it, so bytes whose load failed can never become readable or be
        queued for L2 as if freshly written.
        """
        return self._handoffs.reserve_load(keys, sizes, temporary=temporary)

    def finish_load(
        self, objs: Sequence[L1Object], count: int = 1, layouts: Sequence[str] | None = None
    ) -> list[bool]:
        """Loaded objects of ``reserve_load``: READY and read-locked ``count`` times in one
        step, so nothing can evict them before the reader gets them.  False for an object
        that is no longer this reservation (its write TTL passed: deletes and clears skip it).
        ``layouts``: each object's tensor layout as its stored record gave it ("" unknown)."""
        return self._handoffs.finish_load(objs, count, layouts)

    def abort_load(self, objs: Iterable[L1Object]) -> None:
        """Free ``reserve_load`` objects that will not be finished (failed, or not needed),
        once their load is over; objects finished meanwhile are left alone.  An object whose
        write TTL already took it out of L1 gives its held extent back now."""
        self._handoffs.abort_load(objs)

    # -- removal -----------------------------------------------------------------------

    def delete(self, keys: Sequence[ObjectKey], *, force: bool = False) -> list[bool]:
        """Free objects; read-locked ones are skipped unless ``force``, objects being
        written always (only abort_write or the write TTL ends a reservation, whose writer
        may be copying into it).  A read-locked object deleted by force leaves L1 at once;
        its extent is held until its readers release it or their lease ends."""
        return self._removal.delete(keys, force=force)

    def evict(self, bytes_to_free: int, victims: Iterable[ObjectKey]) -> list[ObjectKey]:
        """``make_room`` sparing nothing; returns the evicted keys."""
        return self._removal.make_room(bytes_to_free, victims, spare_unstored=False).keys

    def make_room(
        self,
        bytes_to_free: int,
        victims: Iterable[ObjectKey],
        *,
        spare_unstored: bool = False,
        passed_locked: list[ObjectKey] | None = None,
        unknown: list[ObjectKey] | None = None,
    ) -> Eviction:
        """Delete unlocked READY victims, in the given order, until ``bytes_to_free`` aligned
        bytes are freed or the victims run out (among stored victims, an extent held back
        for the grace period of an expired lock frees nothing yet, so it does not count).

        Objects still waiting for their L2 store (``mark_unstored``) are passed over while
        the others can free the room: losing one loses an acknowledged write.  Only when
        every other victim is not enough are they evicted, in victim order, and reported in
        ``Eviction.unstored``; with ``spare_unstored`` never.

        ``passed_locked``, when given, receives the keys of the read-locked READY victims
        passed over, in victim order, and L1 remembers them as set aside: a caller whose
        policy leaves them out of its walks until their locks end
        (``take_unlocked_set_aside``) walks past each locked object once, not on every
        eviction.  ``unknown``, when given, receives the victims L1 holds no READY object of
        (not held, or being written), skipped: a policy hears only of READY keys and of
        removals, so a correct one offers none.
        """
        return self._removal.make_room(
            bytes_to_free,
            victims,
            spare_unstored=spare_unstored,
            passed_locked=passed_locked,
            unknown=unknown,
        )

    def take_unlocked_set_aside(self) -> list[ObjectKey]:
        """The keys ``make_room`` set aside whose objects are no longer locked (their locks
        ended, or they left L1), in the order that happened; each is returned once.  A
        caller puts them back into its policy's walks before it walks again.  Costs the
        keys returned: each unlock of an object set aside records it (a set probe)."""
        return self._removal.take_unlocked_set_aside()

    def expire_locks(self, now: float | None = None, budget: int = REAP_BATCH) -> int:
        """Reap locks past their TTL, as if their crashed holders had released them.

        An expired write reservation is freed; expired read locks are dropped, each at its
        own deadline (an object left with none, and temporary, is freed). Either way the
        extent is not reused for the lease grace period, in case its holder is only slow;
        quarantined extents whose lease has ended are reclaimed. Returns the number of
        objects some of whose locks expired. ``now`` is a ``time.monotonic()`` value.
        One call looks at ``budget`` objects at most (a short hold of the L1 lock): while
        :attr:`reap_backlog` says more are due, call again.
        """
        return self._removal.expire_locks(time.monotonic() if now is None else now, budget)

    @property
    def reap_backlog(self) -> bool:
        """Whether the last :meth:`expire_locks` stopped at its budget with locks still due."""
        return self._removal.reap_backlog

    def clear(self, *, force: bool = False, cleared_unstored: list[L1Object] | None = None) -> int:
        """Delete every object in L1 when the call begins (unlocked ones only unless
        ``force``; never one being written); returns how many.

        The lock is let go every ``CLEAR_BATCH`` objects, so stores and lookups are served
        during a long clear: objects stored meanwhile stay (``l1/removal.py``).  Holding
        :attr:`lock` around the call makes it one step again, and holds everyone up as
        long.  ``cleared_unstored``, when given, receives the objects removed before their
        L2 store started (see :meth:`mark_unstored`), acknowledged writes now in no tier.
        """
        return self._removal.clear(force=force, cleared_unstored=cleared_unstored)

    def generations(self, objs: Sequence[L1Object]) -> list[int]:
        """The generation of each object's extent now (0s for an NVMe L1): a reader that
        finds the same value in the arena's table after copying read the object's bytes.

        Only while the extent is still the object's: asked about a write reservation (which
        nothing but its writer, or fencing, ends), that holds.  For read-locked objects ask
        :meth:`reserve_read_prefix` for them instead, in the hold that takes the locks."""
        return self._leases.generations(objs)

    def failures(self) -> dict[str, int]:
        """L1's own failures by reason, counted since start-up (only those that happened):
        for an NVMe L1, write-back errors of its file (``l1_nvme_writeback_error``), copies
        refused for one (``..._refused``), objects dropped for one (``..._dropped``; those of
        them not stored in L2 yet, lost acknowledged writes, also ``..._lost_before_l2``), and
        ``l1_nvme_sync_file_range_refused`` once the system refused that call (fdatasync
        asks instead), reads of its file that failed, each dropping its object
        (``l1_nvme_read_error``; ``..._lost_before_l2`` as above), writes into it that
        failed, each failing its store or load (``l1_nvme_write_error``); writes skipped behind
        another writer's reservation of their key that then ended uncommitted
        (``l1_skipped_writes_lost``: acknowledged writes in no tier),
        and loads that gave way to a writer of their key (``l1_load_taken_over_by_write``);
        reads answered a miss because L1 closed during their copy (``l1_read_closed``), and
        writes failed for it (``l1_write_closed``: the store is not committed);
        notifications a listener raised on, the first logged with its traceback, later
        ones once per burst (``l1_listener_error``: the listener may have missed those changes);
        fixed at start-up, the leftover block files of other servers in an NVMe L1's
        directory that it removed (``l1_nvme_stale_files_removed``: their creators were
        killed) or left in place (``l1_nvme_stale_files_kept``: disk space still taken),
        each also logged; at close, transfers of an NVMe L1's file still running when close
        stopped waiting for them (``l1_nvme_close_transfers_left``: a hung disk; the file
        is released when the last ends), logged."""
        with self.lock:
            skipped = self._skipped.counts()
            listener_errors = self._table.listeners.errors
        failures = self._bytes.failures() | skipped
        if listener_errors:
            failures["l1_listener_error"] = listener_errors
        return failures

    def lease_stats(self) -> LeaseStats:
        with self.lock:
            return self._leases.stats()

    def reclaimable_bytes(self) -> int:
        """Free bytes plus what evicting every unlocked object would free now: the most any
        reservation can get, whatever the eviction policy picks.  An unlocked object whose
        locks expired within the grace period counts as unevictable: evicting it holds its
        extent back until the period ends."""
        with self.lock:
            # Running totals (``l1/table.py``): every write that finds L1 full asks this.
            unevictable = self._table.unevictable_bytes + self._leases.quarantined_bytes
            lapsed = self._leases.lapsed_unlocked(time.monotonic())
            return self._allocator.capacity - unevictable - sum(obj.extent_bytes for obj in lapsed)

    def unevictable_extents(self) -> int:
        """How many extents no eviction frees now (locked objects', those held for loads,
        quarantined ones, unlocked ones in their expired locks' grace period):
        :meth:`reclaimable_bytes` lies in at most one span more."""
        with self.lock:
            lapsed = self._leases.lapsed_unlocked(time.monotonic())
            return self._table.unevictable_count() + self._leases.quarantined_extents + len(lapsed)

    def reclaimable_spans(self) -> list[int]:
        """The lengths of the free extents that evicting every unlocked object would leave:
        the gaps between the extents no eviction frees now (locked objects', those held for
        loads, quarantined ones, unlocked ones in their expired locks' grace period).  It
        sorts those extents: asked only when a write found no room and
        :meth:`unevictable_extents` does not tell that it fits.

        On a full L1 much of which is locked, every write that finds no room asks it, so
        only the lists of those extents' records are copied under the lock (in C, a
        pointer each).  Their offsets and lengths never change for a record's life, so they
        are read into arrays, sorted and gapped after it is let go: reading them under it
        held every store and lookup up for ~15 ms per write with 100k locked objects
        (sorting tuples made by a Python call per extent, before that: ~240 ms)."""
        with self.lock:
            objs = self._table.unevictable()
            objs += self._leases.held_objects()
            objs += self._leases.lapsed_unlocked(time.monotonic())
            held = self._leases.held_entries()
            capacity = self._allocator.capacity
        count = len(objs) + len(held)
        offsets = np.fromiter(chain(map(_OFFSET, objs), map(_HELD_OFFSET, held)), dtype=np.int64, count=count)
        lengths = np.fromiter(
            chain(map(_EXTENT_BYTES, objs), map(_EXTENT_BYTES, held)), dtype=np.int64, count=count
        )
        return _gaps(offsets, lengths, capacity)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (every object was dropped then, none counted)."""
        return self._table.closed

    def close(self) -> None:
        """Drop every object without notifying listeners and release the arena. Idempotent.

        The backing is released after the lock is let go: an NVMe file waits for its
        transfers in progress first, up to ``l1.nvme.CLOSE_WAIT_S`` if one is stuck on a
        hung disk, and every other L1 call (each finding L1 closed now) would wait as long.
        """
        with self.lock:
            if self._table.closed:
                return
            self._table.close()
            self._leases.close()
        self._backing.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _gaps(offsets: np.ndarray, lengths: np.ndarray, capacity: int) -> list[int]:
    """The lengths of the stretches of ``[0, capacity)`` that none of the extents
    ``(offsets[i], lengths[i])`` (in any order, overlaps allowed) covers, by address."""
    if not len(offsets):
        return [capacity] if capacity > 0 else []
    order = np.argsort(offsets, kind="stable")
    starts = offsets[order]
    # How far the extents up to each one cover: a gap opens before an extent that starts
    # past every earlier extent's end.
    covered = np.maximum.accumulate(starts + lengths[order])
    before = starts - np.concatenate(([0], covered[:-1]))
    gaps = before[before > 0].tolist()
    tail = capacity - int(covered[-1])
    return [*gaps, tail] if tail > 0 else gaps
