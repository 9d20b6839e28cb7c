"""L1Manager under random interleavings: no extent changes hands while anyone may still touch it.

Holders are what may still read or write an object's extent: readers (until they release
or their lock TTL ends), writers (until they commit, abort or their write TTL ends),
prefetch loads (until finished or aborted) and L2 store tasks (until they report).  Random
call sequences, on a clock the test moves, check after every step that each holder's
extent still holds its object's bytes and generation, that every allocated extent has
exactly one owner (a live object, the quarantine, or a load), and that everything goes
back once every holder has let go.

Readers of one key release in the order they took their locks: a release arrives by key,
and the quarantine credits it to the oldest extent of that key first (``l1/leases.py``).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object, ObjectState
from lmcache_tiers.l1 import manager as manager_module
from lmcache_tiers.l1 import reads as reads_module
from lmcache_tiers.l1 import removal as removal_module
from lmcache_tiers.l1 import table as table_module
from lmcache_tiers.l1 import writes as writes_module

ALIGN = 4096
UNITS = 32
LOCK_TTL = 10.0
WRITE_TTL = 10.0
GRACE = 2.0
KEYS = [ObjectKey("stress", 0, bytes([index])) for index in range(1, 11)]
FOREVER = float("inf")


class FakeClock:
    """Stands in for the ``time`` module of the L1 parts that read the monotonic clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    for module in (manager_module, reads_module, removal_module, table_module, writes_module):
        monkeypatch.setattr(module, "time", fake)
    return fake


@pytest.fixture
def l1(clock: FakeClock) -> Iterator[L1Manager]:
    manager = L1Manager(
        UNITS * ALIGN,
        align=ALIGN,
        lock_ttl_s=LOCK_TTL,
        write_ttl_s=WRITE_TTL,
        lease_grace_s=GRACE,
        prefault=False,
    )
    yield manager
    manager.close()


@dataclass(eq=False)
class Holder:
    kind: str  # "reader", "writer", "load" or "store"
    objs: list[L1Object]
    generations: list[int]
    deadline: float  # after it the holder is gone (released or crashed); loads and stores never lapse
    count: int = 1  # read locks of a reader
    seq: int = 0  # readers of one key release in this order


@dataclass
class Harness:
    l1: L1Manager
    clock: FakeClock
    rng: random.Random
    holders: list[Holder] = field(default_factory=list)
    fills: dict[L1Object, bytes] = field(default_factory=dict)  # each object's bytes
    seq: int = 0

    # -- holders -------------------------------------------------------------------------

    def hold(self, kind: str, objs: list[L1Object], ttl: float, count: int = 1) -> Holder:
        self.seq += 1
        holder = Holder(kind, objs, self.l1.generations(objs), self.clock.now + ttl, count, self.seq)
        self.holders.append(holder)
        return holder

    def drop(self, holder: Holder) -> None:
        self.holders.remove(holder)

    def of_kind(self, kind: str) -> list[Holder]:
        return [holder for holder in self.holders if holder.kind == kind]

    def fill(self, obj: L1Object) -> None:
        self.fills[obj] = bytes([self.rng.randrange(256)]) * obj.size
        self.l1.write_object(obj, memoryview(self.fills[obj]))

    def oldest_reader(self, key: ObjectKey) -> Holder:
        return min((h for h in self.of_kind("reader") if h.objs[0].key == key), key=lambda h: h.seq)

    # -- operations ----------------------------------------------------------------------

    def random_keys(self, most: int = 4) -> list[ObjectKey]:
        return [self.rng.choice(KEYS) for _ in range(self.rng.randint(1, most))]

    def write(self) -> None:
        batch = self.random_keys()
        sizes = [self.rng.randint(1, 4) * ALIGN - self.rng.choice((0, 1, 100)) for _ in batch]
        try:
            reserved = self.l1.reserve_write(batch, sizes, temporary=self.rng.random() < 0.3)
        except L1OutOfMemoryError:
            self.l1.make_room(sum(sizes), list(KEYS), spare_unstored=self.rng.random() < 0.5)
            return
        for obj in reserved.values():
            self.fill(obj)
            self.hold("writer", [obj], WRITE_TTL)

    def commit(self) -> None:
        writers = self.of_kind("writer")
        if not writers:
            return
        writer = self.rng.choice(writers)
        obj = writer.objs[0]
        self.drop(writer)
        roll = self.rng.random()
        if roll < 0.2:
            self.l1.abort_write([obj.key])
        elif roll < 0.6:
            assert self.l1.finish_write([obj.key]) == [True]
            if self.rng.random() < 0.3:
                self.l1.mark_unstored([obj.key])
        else:
            count = self.rng.randint(1, 2)
            assert self.l1.finish_write_and_reserve_read([obj.key], count) == [True]
            self.hold("reader", [obj], LOCK_TTL, count)

    def read(self) -> None:
        batch, count = self.random_keys(), self.rng.randint(1, 2)
        if self.rng.random() < 0.5:
            objs = list(self.l1.reserve_read(batch, count).values())
        else:
            prefix = self.l1.reserve_read_prefix(batch, count, until_repeat=self.rng.random() < 0.5)
            objs = list(dict.fromkeys(prefix))
        for obj in objs:
            self.hold("reader", [obj], LOCK_TTL, count)

    def release(self) -> None:
        readers = self.of_kind("reader")
        if not readers:
            return
        reader = self.oldest_reader(self.rng.choice(readers).objs[0].key)
        self.drop(reader)
        self.l1.finish_read([reader.objs[0].key], reader.count)

    def store(self) -> None:
        objs = list(self.l1.reserve_store(self.random_keys()).values())
        if objs:
            self.hold("store", objs, FOREVER)

    def finish_store(self) -> None:
        stores = self.of_kind("store")
        if stores:
            store = self.rng.choice(stores)
            self.drop(store)
            self.l1.settle_unstored(store.objs)
            self.l1.finish_store(store.objs)

    def load(self) -> None:
        batch = self.random_keys(2)
        try:
            reserved = self.l1.reserve_load(batch, [ALIGN] * len(batch), temporary=self.rng.random() < 0.5)
        except L1OutOfMemoryError:
            return
        for obj in reserved.values():
            self.fills[obj] = bytes([self.rng.randrange(256)]) * obj.size
            loan = self.l1.lend(obj, fill=True)
            loan.buffer[:] = self.fills[obj]
            loan.commit()
            self.hold("load", [obj], FOREVER)

    def finish_load(self) -> None:
        loads = self.of_kind("load")
        if not loads:
            return
        load = self.rng.choice(loads)
        self.drop(load)
        (obj,) = load.objs
        count = self.rng.randint(1, 2)
        if self.rng.random() < 0.7 and self.l1.finish_load([obj], count) == [True]:
            self.hold("reader", [obj], LOCK_TTL, count)
        else:
            self.l1.abort_load([obj])

    def remove(self) -> None:
        roll = self.rng.random()
        if roll < 0.4:
            self.l1.delete(self.random_keys(), force=self.rng.random() < 0.5)
        elif roll < 0.8:
            victims = self.random_keys(8)
            self.l1.make_room(self.rng.randint(1, 8) * ALIGN, victims, spare_unstored=self.rng.random() < 0.5)
        else:
            self.l1.clear(force=self.rng.random() < 0.7)

    def set_temporary(self) -> None:
        self.l1.set_temporary(self.random_keys(), self.rng.random() < 0.5)

    def advance(self) -> None:
        """Move the clock; readers and writers whose TTL ends first either let go in time
        or crash (never call again).  Then reap what expired."""
        now = self.clock.now + self.rng.uniform(0.0, 4.0)
        for holder in sorted(self.holders, key=lambda h: h.seq):
            if holder not in self.holders or holder.deadline > now:
                continue
            if self.rng.random() < 0.5:
                self.drop(holder)  # crashed
            elif holder.kind == "reader":
                # In time, behind the older readers of its key.
                for reader in sorted(self.of_kind("reader"), key=lambda h: h.seq):
                    if reader.objs[0].key == holder.objs[0].key and reader.seq <= holder.seq:
                        self.drop(reader)
                        self.l1.finish_read([reader.objs[0].key], reader.count)
            else:
                self.drop(holder)
                self.l1.abort_write([holder.objs[0].key])
        self.clock.now = now
        self.l1.expire_locks()

    def step(self) -> None:
        operation = self.rng.choices(
            [
                self.write,
                self.commit,
                self.read,
                self.release,
                self.store,
                self.finish_store,
                self.load,
                self.finish_load,
                self.remove,
                self.set_temporary,
                self.advance,
            ],
            weights=[6, 5, 5, 5, 2, 2, 2, 2, 3, 1, 2],
        )[0]
        operation()

    def let_go_of_everything(self) -> None:
        for holder in sorted(self.holders, key=lambda h: h.seq):
            if holder.kind == "reader":
                self.l1.finish_read([holder.objs[0].key], holder.count)
            elif holder.kind == "writer":
                self.l1.abort_write([holder.objs[0].key])
            elif holder.kind == "load":
                self.l1.abort_load(holder.objs)
            else:
                self.l1.finish_store(holder.objs)
        self.holders.clear()


# -- checks ----------------------------------------------------------------------------------


def check_holders(harness: Harness) -> None:
    """Every holder's extent still holds its object's bytes, under the same generation."""
    l1 = harness.l1
    buffer = l1.arena.buffer
    for holder in harness.holders:
        assert l1.generations(holder.objs) == holder.generations, f"{holder.kind}'s extent went back"
        for obj in holder.objs:
            assert buffer[obj.offset : obj.offset + obj.size] == harness.fills[obj], (
                f"{holder.kind} of {obj.key} sees another object's bytes"
            )


def check_owners(l1: L1Manager, holders: list[Holder]) -> None:
    """Each allocated extent has exactly one owner, and holders' extents are owned by
    their own object (live, quarantined or held for an adapter)."""
    allocator, table, leases = l1._allocator, l1._table, l1._leases
    live = {obj.offset: obj for obj in table.objects.values()}
    quarantined = {offset: entry.obj for offset, entry in leases._by_offset.items()}
    assert not quarantined.keys() & leases._bare.keys(), "an extent quarantined twice"
    quarantined.update(leases._bare)
    held = {obj.offset: obj for obj in table._held}
    assert len(live) == len(table.objects), "two live objects at one offset"
    assert len(held) == len(table._held), "two held objects at one offset"
    owners = [live, quarantined, held]
    for index, first in enumerate(owners):
        for second in owners[index + 1 :]:
            assert not first.keys() & second.keys(), "an extent with two owners"
    owned = {**live, **quarantined, **held}
    assert set(owned) == set(allocator._used), "allocated extents without an owner, or owners without one"
    for offset, obj in owned.items():
        assert allocator._used[offset] == allocator.extent_size(obj.size)
    for holder in holders:
        for obj in holder.objs:
            assert owned.get(obj.offset) is obj, f"{holder.kind}'s extent belongs to another object"
    assert leases.quarantined_bytes == sum(allocator._used[offset] for offset in quarantined)
    # Unlocked objects whose expired locks' grace period runs: evicting them frees nothing yet.
    now = manager_module.time.monotonic()  # the fake clock L1 reads
    in_grace = {
        obj.offset: obj
        for obj in table.objects.values()
        if obj.state is ObjectState.READY and not obj.read_locks and leases._lapsed.get(obj.offset, 0.0) > now
    }
    unmovable = {**quarantined, **held, **in_grace, **{obj.offset: obj for obj in table.locked.values()}}
    assert l1.reclaimable_bytes() == allocator.capacity - sum(allocator._used[offset] for offset in unmovable)


def check_allocator(l1: L1Manager) -> None:
    allocator = l1._allocator
    assert allocator.allocated_bytes == sum(allocator._used.values())
    spans = sorted([*allocator._used.items(), *allocator.free_extents()])
    position = 0
    for offset, length in spans:
        assert offset == position, "extents overlap or leave a gap"
        position += length
    assert position == allocator.capacity


def check_table(l1: L1Manager) -> None:
    table = l1._table
    for key, obj in table.objects.items():
        assert obj.key == key and obj.read_locks >= 0 and obj.storing >= 0
        assert (key in table.locked) == obj.locked
        assert (key in table.ready) == (obj.state is ObjectState.READY)
        assert (key in table.temporary) == obj.temporary
    assert table.locked.keys() <= table.objects.keys()
    assert table.ready.keys() <= table.objects.keys()
    assert table.temporary <= table.objects.keys()
    assert table.unstored_bytes == sum(obj.size for obj in table.objects.values() if obj.unstored)
    stats = l1.stats()
    assert stats.read_locks >= 0 and stats.used_bytes == l1.used_bytes


def check_deadlines(l1: L1Manager) -> None:
    """The reap's index finds every lock it must reap: each reservation in ``writing``, in
    deadline order, and each reader lock's object under its deadline's cell (or stalled
    behind an L2 store, if that cell ended)."""
    table, deadlines = l1._table, l1._table.deadlines
    writing = [obj for obj in table.objects.values() if obj.state is ObjectState.WRITING]
    assert set(deadlines.writing) == set(writing)
    ends = [obj.lock_deadline for obj in deadlines.writing]
    assert ends == sorted(ends), "reservations out of deadline order"
    for obj in table.locked.values():
        if obj.state is ObjectState.WRITING or obj.read_locks == obj.storing:
            continue
        groups = obj.lock_groups or [obj.lock_deadline, obj.read_locks - obj.storing]
        for deadline in groups[::2]:
            assert obj in deadlines._cells.get(deadline, ()) or obj in deadlines._stalled, (
                "a reader's lock the reap would never find"
            )
    assert sorted(deadlines._ends) == sorted(deadlines._cells)


def check_everything(harness: Harness) -> None:
    check_allocator(harness.l1)
    check_table(harness.l1)
    check_deadlines(harness.l1)
    check_owners(harness.l1, harness.holders)
    check_holders(harness)


def check_all_given_back(l1: L1Manager) -> None:
    l1.expire_locks(now=FOREVER)
    l1.clear(force=True)
    assert l1.expire_locks(now=FOREVER) == 0
    assert l1.used_bytes == 0 and len(l1) == 0
    assert l1.lease_stats().quarantined_bytes == 0 and l1.lease_stats().quarantined_extents == 0
    assert l1._allocator.free_extents() == [(0, l1.capacity_bytes)]
    assert l1.reclaimable_bytes() == l1.capacity_bytes


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_never_hand_a_held_extent_to_another_object(
    l1: L1Manager, clock: FakeClock, seed: int
) -> None:
    harness = Harness(l1, clock, random.Random(seed))
    for _ in range(600):
        harness.step()
        check_everything(harness)
    harness.let_go_of_everything()
    check_everything(harness)
    check_all_given_back(l1)


def test_threads_forcing_objects_out_never_change_bytes_under_their_holders() -> None:
    """Writers and readers on their own keys, while another thread clears by force, evicts
    and runs L2 stores on any key: every holder reads its own bytes until it lets go."""
    l1 = L1Manager(UNITS * ALIGN, align=ALIGN, lease_grace_s=GRACE, prefault=False)
    errors: list[BaseException] = []
    done = threading.Event()

    def worker(index: int) -> None:
        rng = random.Random(index)
        own = [ObjectKey("threads", index, bytes([n])) for n in range(8)]
        try:
            for _ in range(300):
                batch = rng.sample(own, rng.randint(1, 3))
                try:
                    reserved = l1.reserve_write(batch, [rng.randint(1, 3) * ALIGN for _ in batch])
                except L1OutOfMemoryError:
                    l1.make_room(4 * ALIGN, own)
                    continue
                fills = {obj: bytes([rng.randrange(256)]) * obj.size for obj in reserved.values()}
                for obj, data in fills.items():
                    l1.write_object(obj, memoryview(data))
                assert all(l1.finish_write_and_reserve_read(list(reserved)))
                held = list(fills)
                generations = l1.generations(held)
                for _ in range(3):  # others run meanwhile
                    for obj in held:
                        out = bytearray(obj.size)
                        l1.read_object(obj, memoryview(out))
                        assert out == fills[obj], f"{obj.key} changed under its reader"
                    assert l1.generations(held) == generations
                l1.finish_read([obj.key for obj in held])
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    def chaos() -> None:
        rng = random.Random(99)
        stores: list[list[L1Object]] = []
        try:
            while not done.is_set():
                with l1.lock:
                    everything = list(l1._table.objects)  # a snapshot; keys may be gone by now
                if everything:
                    chosen = rng.sample(everything, min(3, len(everything)))
                    stores.append(list(l1.reserve_store(chosen).values()))
                if len(stores) > 3 or (stores and rng.random() < 0.3):
                    l1.finish_store(stores.pop(0))
                if rng.random() < 0.3:
                    l1.clear(force=True)
                else:
                    l1.make_room(rng.randint(1, 8) * ALIGN, everything)
                l1.expire_locks()
            for objs in stores:
                l1.finish_store(objs)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    troublemaker = threading.Thread(target=chaos)
    try:
        for thread in [*workers, troublemaker]:
            thread.start()
        for thread in workers:
            thread.join()
        done.set()
        troublemaker.join()
        assert errors == []
        check_allocator(l1)
        check_table(l1)
        check_owners(l1, [])
        assert l1.stats().read_locks == 0 and l1.stats().write_locked == 0
        check_all_given_back(l1)
    finally:
        done.set()
        l1.close()
