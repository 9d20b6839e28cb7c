"""L1Manager against a plain model: random call sequences keep state, bytes and notifications exact.

Runs on the shared-memory arena and on the NVMe file: an object's bytes must survive
whatever happens to its neighbours' extents.  Loads from L2 (a prefetch's reservations,
which a client's write of the same key takes over) and writes skipped behind another
writer's reservation (lost when it ends uncommitted) are modelled with their counts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object, ObjectState

ALIGN = 4096
UNITS = 24
KEYS = [ObjectKey("model", 0, bytes([index + 1])) for index in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=5)
# positions in the list of loads not yet ended (taken modulo its length)
load_picks = st.lists(st.integers(0, 15), min_size=1, max_size=3)


@dataclass
class Entry:
    units: int
    temporary: bool
    writing: bool = True
    read_locks: int = 0
    #: the prefetch's reservation this entry is, while it is being loaded
    load: L1Object | None = None
    #: writes of its key skipped behind this (writer's) reservation
    skipped: int = 0


class Notifications:
    def __init__(self) -> None:
        self.written: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []

    def on_l1_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self.written.extend(keys)

    def on_l1_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def on_l1_keys_deleted(self, keys: Sequence[ObjectKey]) -> None:
        self.deleted.extend(keys)


def contents(k: ObjectKey, size: int) -> bytes:
    return k.chunk_hash * size


class ManagerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = self.make_manager()
        self.notes = Notifications()
        self.l1.add_listener(self.notes)
        self.model: dict[ObjectKey, Entry] = {}
        self.removed: list[ObjectKey] = []
        # extents of read-locked objects deleted by force: [units, locks still held], per key
        self.quarantined: dict[ObjectKey, list[list[int]]] = {}
        # loads not yet ended by abort_load: (object, units), and the units of those that
        # left L1 while loading (taken over by a writer, or reaped), held until abort_load
        self.loads: list[tuple[L1Object, int]] = []
        self.held_loads: dict[int, int] = {}
        self.skipped_lost = 0
        self.loads_taken_over = 0

    def make_manager(self) -> L1Manager:
        return L1Manager(UNITS * ALIGN, align=ALIGN, prefault=False)

    def teardown(self) -> None:
        self.l1.close()

    def _remove(self, key: ObjectKey) -> None:
        del self.model[key]
        self.removed.append(key)

    @rule(batch=key_lists, units=st.lists(st.integers(1, 6), min_size=5, max_size=5), temporary=st.booleans())
    def reserve_write(self, batch: list[ObjectKey], units: list[int], temporary: bool) -> None:
        sizes = [n * ALIGN - 7 for n in units[: len(batch)]]
        fresh: dict[ObjectKey, int] = {}
        skipped: set[ObjectKey] = set()
        for k, n in zip(batch, units, strict=False):
            entry = self.model.get(k)
            if entry is None or entry.load is not None:  # a writer takes a key from its load
                fresh.setdefault(k, n)  # a key repeated in a batch: the first size wins
            elif entry.writing:
                skipped.add(k)
        try:
            reserved = self.l1.reserve_write(batch, sizes, temporary=temporary)
        except L1OutOfMemoryError:
            return
        assert list(reserved) == list(fresh)
        for k in skipped:
            self.model[k].skipped += 1
        for k, n in fresh.items():
            taken = self.model.get(k)
            if taken is not None:
                assert taken.load is not None
                self.held_loads[id(taken.load)] = taken.units
                self.loads_taken_over += 1
                self._remove(k)
            self.model[k] = Entry(n, temporary)
            self.l1.write_object(reserved[k], memoryview(contents(k, reserved[k].size)))

    @rule(batch=key_lists, units=st.lists(st.integers(1, 6), min_size=5, max_size=5), temporary=st.booleans())
    def reserve_load(self, batch: list[ObjectKey], units: list[int], temporary: bool) -> None:
        sizes = [n * ALIGN - 7 for n in units[: len(batch)]]
        fresh: dict[ObjectKey, int] = {}
        for k, n in zip(batch, units, strict=False):
            if k not in self.model:  # a load never takes a key from anyone
                fresh.setdefault(k, n)
        try:
            reserved = self.l1.reserve_load(batch, sizes, temporary=temporary)
        except L1OutOfMemoryError:
            return
        assert list(reserved) == list(fresh)
        for k, n in fresh.items():
            obj = reserved[k]
            self.model[k] = Entry(n, temporary, load=obj)
            self.loads.append((obj, n))
            self.l1.write_object(obj, memoryview(contents(k, obj.size)))

    def _picked_loads(self, picks: list[int]) -> list[L1Object]:
        return [self.loads[pick % len(self.loads)][0] for pick in picks]

    @precondition(lambda self: bool(self.loads))
    @rule(picks=load_picks, count=st.integers(1, 2))
    def finish_load(self, picks: list[int], count: int) -> None:
        objs = self._picked_loads(picks)
        result = self.l1.finish_load(objs, count)
        expected = []
        for obj in objs:
            entry = self.model.get(obj.key)
            ok = entry is not None and entry.load is obj
            expected.append(ok)
            if entry is not None and ok:
                entry.load = None
                entry.writing = False
                entry.read_locks = count
        assert result == expected

    @precondition(lambda self: bool(self.loads))
    @rule(picks=load_picks)
    def abort_load(self, picks: list[int]) -> None:
        objs = self._picked_loads(picks)
        self.l1.abort_load(objs)
        for obj in dict.fromkeys(objs):
            self.held_loads.pop(id(obj), None)
            entry = self.model.get(obj.key)
            if entry is not None and entry.load is obj:
                self._remove(obj.key)
        self.loads = [(obj, n) for obj, n in self.loads if obj not in objs]

    @rule(batch=key_lists, count=st.integers(0, 2))
    def finish_write(self, batch: list[ObjectKey], count: int) -> None:
        # count 0 stands for plain finish_write; 1..2 for the hand-off to readers
        finish = (
            self.l1.finish_write_and_reserve_read if count else lambda keys, _: self.l1.finish_write(keys)
        )
        result = finish(batch, count)
        expected = []
        for k in batch:
            entry = self.model.get(k)
            ok = entry is not None and entry.writing and entry.load is None  # loads: finish_load only
            expected.append(ok)
            if entry is not None and ok:
                entry.writing = False
                entry.read_locks = count
        assert result == expected

    @rule(batch=key_lists)
    def abort_write(self, batch: list[ObjectKey]) -> None:
        self.l1.abort_write(batch)
        for k in dict.fromkeys(batch):
            entry = self.model.get(k)
            if entry is not None and entry.writing and entry.load is None:
                self.skipped_lost += entry.skipped
                self._remove(k)

    @rule(batch=key_lists, count=st.integers(1, 2))
    def reserve_read(self, batch: list[ObjectKey], count: int) -> None:
        hits = self.l1.reserve_read(batch, count)
        expected = [k for k in dict.fromkeys(batch) if k in self.model and not self.model[k].writing]
        assert list(hits) == expected
        for k in expected:
            self.model[k].read_locks += count

    @rule(batch=key_lists, count=st.integers(1, 2))
    def reserve_read_prefix(self, batch: list[ObjectKey], count: int) -> None:
        prefix = self.l1.reserve_read_prefix(batch, count)
        expected: list[ObjectKey] = []
        for k in batch:
            if k not in self.model or self.model[k].writing:
                break
            expected.append(k)
        assert [obj.key for obj in prefix] == expected
        for k in dict.fromkeys(expected):
            self.model[k].read_locks += count

    @rule(batch=key_lists, count=st.integers(1, 2))
    def finish_read(self, batch: list[ObjectKey], count: int) -> None:
        self.l1.finish_read(batch, count)
        for k in dict.fromkeys(batch):
            left = count
            held = self.quarantined.get(k, [])
            while held and left:  # quarantined extents are credited first, oldest first
                taken = min(left, held[0][1])
                held[0][1] -= taken
                left -= taken
                if held[0][1] == 0:
                    held.pop(0)
            entry = self.model.get(k)
            if entry is None or entry.read_locks == 0 or not left:
                continue
            entry.read_locks = max(0, entry.read_locks - left)
            if entry.read_locks == 0 and entry.temporary:
                self._remove(k)

    @rule(batch=key_lists, force=st.booleans())
    def delete(self, batch: list[ObjectKey], force: bool) -> None:
        result = self.l1.delete(batch, force=force)
        expected = []
        for k in batch:
            entry = self.model.get(k)
            ok = entry is not None and not entry.writing and (force or entry.read_locks == 0)
            expected.append(ok)
            if ok:
                assert entry is not None
                if entry.read_locks:
                    self.quarantined.setdefault(k, []).append([entry.units, entry.read_locks])
                self._remove(k)
        assert result == expected

    @rule(victims=key_lists, units=st.integers(0, 8))
    def evict(self, victims: list[ObjectKey], units: int) -> None:
        evicted = self.l1.evict(units * ALIGN, victims)
        expected: list[ObjectKey] = []
        freed = 0
        for k in victims:
            entry = self.model.get(k)
            if units == 0 or freed >= units * ALIGN:
                break
            if entry is None or entry.writing or entry.read_locks or k in expected:
                continue
            expected.append(k)
            freed += entry.units * ALIGN
        assert evicted == expected
        for k in expected:
            self._remove(k)

    @rule()
    def expire_everything(self) -> None:
        locked = [k for k, e in self.model.items() if e.writing or e.read_locks]
        assert self.l1.expire_locks(float("inf")) == len(locked)
        for k in locked:
            entry = self.model[k]
            if entry.load is not None:
                self.held_loads[id(entry.load)] = entry.units  # held until abort_load
            elif entry.writing:
                self.skipped_lost += entry.skipped
            if entry.writing or entry.temporary:
                self._remove(k)
            else:
                entry.read_locks = 0
        self.quarantined.clear()  # at the end of time every lease has ended

    @rule(batch=key_lists, temporary=st.booleans())
    def set_temporary(self, batch: list[ObjectKey], temporary: bool) -> None:
        self.l1.set_temporary(batch, temporary)
        for k in batch:
            if k in self.model:
                self.model[k].temporary = temporary

    @rule(batch=key_lists)
    def read_back(self, batch: list[ObjectKey]) -> None:
        for k in batch:
            obj = self.l1.get(k)
            if obj is None:
                continue
            out = bytearray(obj.size)
            self.l1.read_object(obj, memoryview(out))
            assert out == contents(k, obj.size)

    @invariant()
    def matches_model(self) -> None:
        stats = self.l1.stats()
        assert stats.objects == len(self.model)
        held = sum(units for entries in self.quarantined.values() for units, _ in entries)
        held_loads = sum(self.held_loads.values())
        assert stats.used_bytes == (sum(e.units for e in self.model.values()) + held + held_loads) * ALIGN
        assert self.l1.lease_stats().quarantined_bytes == held * ALIGN
        assert stats.write_locked == sum(e.writing for e in self.model.values())
        assert stats.read_locks == sum(e.read_locks for e in self.model.values())
        assert stats.temporary == sum(e.temporary for e in self.model.values())
        for k, entry in self.model.items():
            obj = self.l1.get(k)
            assert obj is not None
            assert obj.state is (ObjectState.WRITING if entry.writing else ObjectState.READY)
        failures = self.l1.failures()
        assert failures.get("l1_skipped_writes_lost", 0) == self.skipped_lost
        assert failures.get("l1_load_taken_over_by_write", 0) == self.loads_taken_over
        # Every departure reported exactly once (order within one call is not specified).
        assert Counter(self.notes.deleted) == Counter(self.removed)


class NvmeManagerModel(ManagerModel):
    def make_manager(self) -> L1Manager:
        # Hypothesis builds the machine itself, so no pytest fixture can hand it a directory.
        self.directory = tempfile.mkdtemp(prefix="lmcache_tiers_l1_model_")
        return L1Manager(UNITS * ALIGN, align=ALIGN, nvme_path=self.directory)

    def teardown(self) -> None:
        super().teardown()
        remaining = os.listdir(self.directory)
        shutil.rmtree(self.directory)
        assert remaining == [], f"NVMe L1 files left behind: {remaining}"


TestManagerModel = ManagerModel.TestCase
TestManagerModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestNvmeManagerModel = NvmeManagerModel.TestCase
TestNvmeManagerModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
