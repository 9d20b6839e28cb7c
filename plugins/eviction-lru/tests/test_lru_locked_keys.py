"""LRU and L1 eviction: read-locked keys a walk passed over are set aside until their locks
end, so a full L1 whose oldest objects are locked is not walked past all of them on every
write that evicts, while the order of eviction stays the LRU order of the unlocked keys.

The L1 manager and its eviction controller are the real ones, driven by hand (no thread);
the walks are measured by the keys the policy offers, not by time."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import pytest
from lmcache_plugin_eviction_lru.policy import LRUEvictionPolicy

from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.testing.hash_counting import HashCountingKey
from lmcache_tiers.testing.policies import make_keys, put_back_past_an_unstored_key

ALIGN = 4096
BLOCKS = 64
LOCKED = 40  # the oldest objects, read-locked


class CountingLRU(LRUEvictionPolicy):
    """LRU that counts the keys its walks offer."""

    def __init__(self) -> None:
        super().__init__()
        self.offered = 0

    def victims(self) -> Iterator[ObjectKey]:
        for key in super().victims():
            self.offered += 1
            yield key


class FullL1:
    """An L1 of ``BLOCKS`` one-block objects, the ``LOCKED`` oldest read-locked once."""

    def __init__(self) -> None:
        self.l1 = L1Manager(BLOCKS * ALIGN, align=ALIGN, prefault=False)
        self.policy = CountingLRU()
        self.stats = EngineStats(0)
        self.controller = L1EvictionController(
            self.l1, self.policy, trigger_watermark=0.99, eviction_ratio=0.1, stats=self.stats
        )
        self.keys = make_keys(BLOCKS)
        self.locked, self.unlocked = self.keys[:LOCKED], self.keys[LOCKED:]
        self.l1.reserve_write(self.keys, [ALIGN] * BLOCKS)
        # Written one by one, oldest first: the locked ones are the LRU front.
        for key in self.keys:
            if key in self.locked:
                assert self.l1.finish_write_and_reserve_read([key]) == [True]
            else:
                assert self.l1.finish_write([key]) == [True]
        self.written = list(self.keys)  # every key written, oldest first

    def write_one(self) -> tuple[list[ObjectKey], int]:
        """Write a new object into the full L1 as a store does (evict its room, then
        reserve); returns the keys evicted and the keys the walk offered."""
        before = set(self.keys_in_l1())
        offered = self.policy.offered
        assert self.controller.evict_now(ALIGN) == ALIGN
        key = make_keys(1, start=len(self.written))[0]
        self.written.append(key)
        self.l1.reserve_write([key], [ALIGN])
        assert self.l1.finish_write([key]) == [True]
        evicted = sorted(before - set(self.keys_in_l1()), key=self.written.index)
        return evicted, self.policy.offered - offered

    def keys_in_l1(self) -> list[ObjectKey]:
        return [key for key in self.written if self.l1.contains(key)]

    def close(self) -> None:
        self.controller.finish()
        self.l1.close()


@pytest.fixture
def full() -> Iterator[FullL1]:
    setup = FullL1()
    yield setup
    setup.close()


def test_locked_front_is_walked_past_once_not_on_every_write(full: FullL1) -> None:
    first_evicted, first_offered = full.write_one()
    assert first_evicted == [full.unlocked[0]]
    assert first_offered == LOCKED + 1  # past every locked key once
    for position in range(1, 10):
        evicted, offered = full.write_one()
        assert evicted == [full.unlocked[position]], "the oldest unlocked object goes first"
        assert offered == 1, "the locked keys are set aside: the walk starts at a victim"
    assert all(full.l1.contains(key) for key in full.locked), "a locked object is never evicted"
    assert full.stats.failures() == {}


def test_unlocked_keys_are_evicted_first_in_lru_order(full: FullL1) -> None:
    full.write_one()  # sets the locked keys aside
    # Released in the reverse of their age: they still go oldest first, before any other.
    full.l1.finish_read([full.locked[7]])
    full.l1.finish_read([full.locked[2]])
    assert full.write_one()[0] == [full.locked[2]]
    assert full.write_one()[0] == [full.locked[7]]
    assert full.write_one()[0] == [full.unlocked[1]]
    # A key read while set aside is the most recent: released, it goes after the others.
    full.l1.reserve_read([full.locked[0]])  # a second lock, and a read
    full.l1.finish_read([full.locked[0]], 2)
    # Older than it: the other unlocked keys, and the four keys written since the first walk.
    for key in full.unlocked[2:] + make_keys(4, start=BLOCKS):
        assert full.write_one()[0] == [key]
    assert full.write_one()[0] == [full.locked[0]]
    still_locked = [key for key in full.locked if key not in (full.locked[0], full.locked[2], full.locked[7])]
    assert all(full.l1.contains(key) for key in still_locked), "a locked object is never evicted"


def test_a_policy_without_the_hooks_still_skips_locked_keys(full: FullL1) -> None:
    # The same walk on a policy lacking set_aside/put_back: every locked key is passed over
    # again, and none is evicted.
    class Plain:
        def __init__(self, inner: LRUEvictionPolicy) -> None:
            self.inner = inner

        def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
            self.inner.on_keys_written(keys)

        def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
            self.inner.on_keys_read(keys)

        def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
            self.inner.on_keys_removed(keys)

        def victims(self) -> Iterator[ObjectKey]:
            return self.inner.victims()

    full.controller.finish()
    plain = L1EvictionController(
        full.l1, Plain(full.policy), trigger_watermark=0.99, eviction_ratio=0.1, stats=full.stats
    )
    full.controller = plain
    for position in range(3):
        evicted, offered = full.write_one()
        assert evicted == [full.unlocked[position]]
        assert offered == LOCKED + 1
    assert all(full.l1.contains(key) for key in full.locked)


@pytest.mark.parametrize("count", [24, 400])
def test_set_aside_keys_leave_the_lru_order_of_the_others_unchanged(count: int) -> None:
    # A reference LRU holding every key, with walks that pass over the locked ones: the
    # policy's walk is always the reference order without the keys set aside.  With 400
    # keys, keys come back many at a time: their runs merge and drop dead entries.
    rng = random.Random(45 + count)
    keys = make_keys(count)
    policy = LRUEvictionPolicy()
    reference: OrderedDict[ObjectKey, None] = OrderedDict()
    locked: set[ObjectKey] = set()
    aside: set[ObjectKey] = set()

    def touch(batch: Sequence[ObjectKey], *, write: bool) -> None:
        for key in reversed(batch):
            if write or key in reference:
                reference[key] = None
                reference.move_to_end(key)

    for _ in range(3000):
        action = rng.random()
        if action < 0.25:
            batch = rng.sample(keys, rng.randint(1, 4))
            policy.on_keys_written(batch)
            touch(batch, write=True)
            aside -= set(batch)
        elif action < 0.45:
            batch = rng.sample(keys, rng.randint(1, 4))
            policy.on_keys_read(batch)
            touch(batch, write=False)
            aside -= set(batch)
        elif action < 0.55:
            removed = rng.sample(keys, rng.randint(1, 2))
            policy.on_keys_removed(removed)
            for key in removed:
                reference.pop(key, None)
            aside -= set(removed)
        elif action < 0.7:
            # Some locked, some released.
            locked ^= set(rng.sample(keys, rng.randint(1, max(3, count // 16))))
        else:
            # An eviction walk as L1 makes it: released keys put back first, then locked
            # keys passed over, until up to ``wanted`` unlocked ones are evicted.
            policy.put_back([key for key in aside if key not in locked])
            aside &= locked
            wanted, passed, evicted = rng.randint(0, 2), [], []
            for key in policy.victims():
                if len(evicted) == wanted:
                    break
                (passed if key in locked else evicted).append(key)
            policy.on_keys_removed(evicted)
            for key in evicted:
                del reference[key]
            policy.set_aside(passed)
            aside |= set(passed)
        assert list(policy.victims()) == [key for key in reference if key not in aside]
        assert len(policy) == len(reference)


def test_a_put_back_costs_its_own_keys_not_those_waiting() -> None:
    # Under the L1 lock, before every walk: rebuilding the keys waiting to be evicted on
    # each put_back cost ~8 ms with 50,000 waiting.  Keys put back one at a time, among
    # 1,000 waiting: each costs a few hashes of its own key, none of the others'.
    keys = [HashCountingKey(index) for index in range(2000)]
    policy = LRUEvictionPolicy()
    policy.on_keys_written(keys[::-1])  # keys[0] the oldest
    policy.set_aside(keys[:1100])
    policy.put_back(keys[100:1100:2] + keys[101:1100:2])
    HashCountingKey.hashes = 0
    for key in reversed(keys[:100]):
        policy.put_back([key])
    assert HashCountingKey.hashes <= 100 * 4
    assert list(policy.victims()) == keys, "put back in the order they were set aside in"


def test_keys_whose_locks_expire_are_put_back_in_lru_order(full: FullL1) -> None:
    full.write_one()
    assert full.l1.expire_locks(time.monotonic() + 10 * full.l1.lock_ttl_s) == LOCKED
    # Their extents are held back for the lease grace period (they free nothing yet), so
    # the write takes them all, oldest first, before the next unlocked object.
    assert full.write_one()[0] == [*full.locked, full.unlocked[1]]


def test_a_key_set_aside_and_deleted_by_force_is_not_offered_again(full: FullL1) -> None:
    full.write_one()
    assert full.l1.delete([full.locked[0]], force=True) == [True]
    full.l1.finish_read(full.locked[:2])  # the lock on the deleted one goes to its extent
    evicted, offered = full.write_one()
    assert evicted == [full.locked[1]]
    assert offered == 1
    assert len(full.policy) == len(full.l1)


class FlakyPutBack(CountingLRU):
    """LRU whose ``put_back`` raises the first time, before taking any key back."""

    def __init__(self) -> None:
        super().__init__()
        self.put_back_failures = 0

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        if not self.put_back_failures:
            self.put_back_failures += 1
            raise RuntimeError("put_back failed")
        super().put_back(keys)


def test_keys_a_failed_put_back_did_not_take_are_given_back_again(full: FullL1) -> None:
    # A policy whose put_back raised still holds the keys aside: were they forgotten, their
    # objects would never be offered again, and L1 would fill with objects nothing evicts.
    full.controller.finish()
    full.policy = FlakyPutBack()
    for key in full.keys:  # oldest first, as L1 wrote them
        full.policy.on_keys_written([key])
    full.controller = L1EvictionController(
        full.l1, full.policy, trigger_watermark=0.99, eviction_ratio=0.1, stats=full.stats
    )
    assert full.write_one()[0] == [full.unlocked[0]]  # sets the locked keys aside
    full.l1.finish_read([full.locked[3]])
    assert full.write_one()[0] == [full.unlocked[1]], "its put_back failed: the next victim"
    assert full.stats.failures() == {"l1_eviction_policy_error": 1}
    assert full.write_one()[0] == [full.locked[3]], "given back again, it goes first"
    assert full.stats.failures() == {"l1_eviction_policy_error": 1}


def test_locked_keys_deleted_by_force_leave_the_set_aside_record(full: FullL1) -> None:
    # The objects left L1 with their locks, and their readers' releases go to their
    # quarantined extents: no live lock ends.  L1's record of the keys set aside must still
    # forget them at the next walk, or a server whose clients clear locked objects by
    # force would grow it with every key a walk ever passed over.
    full.write_one()
    assert full.l1.delete(full.locked, force=True) == [True] * LOCKED
    full.l1.finish_read(full.locked)
    full.write_one()
    assert full.l1.take_unlocked_set_aside() == []
    assert not full.l1._table.set_aside, "objects no longer in L1 are still recorded"
    assert not full.l1._table.set_aside_ended


def test_a_key_put_back_goes_ahead_of_one_passed_over_unstored() -> None:
    # L1 passes over a victim not yet stored in L2 without setting it aside: it stays in
    # the order, and the key put back goes ahead of it though it was behind (the departure the
    # module docstring names).
    unstored, put_back, walk = put_back_past_an_unstored_key(LRUEvictionPolicy())
    assert walk.index(put_back) < walk.index(unstored)
