"""Walks of a policy's ``victims()``.

Every walk is followed by one removal report -- an empty one when the walk removed
nothing -- so a policy that remembers what a walk offered (ARC) never takes a later
removal for another reason (a client's delete, a temporary prefetch freed after its read)
for that walk's eviction.

A walk is bounded: a policy that offers the same keys again and again (a third-party bug:
one that waits for the caller to remove its head, which is locked) must not hold the L1
lock, or an L2 adapter's listeners, for ever.  A correct policy offers each key it holds
once per walk, so the bound never cuts one short; the walk that hits it ends, counted and
logged."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from l2_backends import DictBackend, Fifo, open_dict
from lmcache_plugin_eviction_arc.policy import ARCEvictionPolicy

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.policies import EvictionPolicy
from lmcache_tiers.testing.blocking import BlockingAdapterClient

ALIGN = 4096
SIZE = 1000


def make_keys(count: int) -> list[ObjectKey]:
    return [ObjectKey("walk-reports", 0, index.to_bytes(8, "big")) for index in range(count)]


class Recording(Fifo):
    """Fifo that records its walks and removal reports in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str | list[ObjectKey]] = []

    def victims(self) -> Iterator[ObjectKey]:
        self.events.append("walk")
        return super().victims()

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        self.events.append(list(keys))
        super().on_keys_removed(keys)


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(8 * ALIGN, align=ALIGN, prefault=False)
    yield manager
    manager.close()


def evicting(l1: L1Manager, policy: EvictionPolicy) -> L1EvictionController:
    return L1EvictionController(l1, policy, trigger_watermark=0.9, eviction_ratio=0.5, stats=EngineStats(0))


@pytest.fixture
def l2() -> Iterator[BackendAdapter]:
    adapter = open_dict(DictBackend, capacity=8 * SIZE)
    yield adapter
    adapter.close()


def evicting_l2(adapter: BackendAdapter, policy: EvictionPolicy) -> L2EvictionController:
    """A controller whose policy is seeded (nothing stored yet): events from now on go in."""
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.5)
    controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))
    controller.evict(0)
    return controller


def stored_in_l2(adapter: BackendAdapter, keys: list[ObjectKey]) -> BlockingAdapterClient:
    client = BlockingAdapterClient(adapter)
    assert client.store(keys, [memoryview(bytearray(SIZE)) for _ in keys]) == [True] * len(keys)
    return client


def stored(l1: L1Manager, keys: list[ObjectKey]) -> None:
    l1.reserve_write(keys, [ALIGN] * len(keys))
    l1.finish_write(keys)


def test_an_l1_walk_that_evicts_nothing_is_ended_by_an_empty_report(l1: L1Manager) -> None:
    policy = Recording()
    controller = evicting(l1, policy)
    keys = make_keys(4)
    stored(l1, keys)
    l1.reserve_read(keys)  # every object is read-locked: nothing can go

    assert controller.evict_now(ALIGN) == 0
    assert policy.events == ["walk", []]

    l1.finish_read(keys)
    assert controller.evict_now(ALIGN) == ALIGN
    assert policy.events[2:] == ["walk", [keys[0]]], "a walk that evicted reports once, with its keys"


def test_an_l2_walk_whose_victims_are_all_pinned_is_ended_by_an_empty_report(l2: BackendAdapter) -> None:
    policy = Recording()
    controller = evicting_l2(l2, policy)
    keys = make_keys(4)
    client = stored_in_l2(l2, keys)
    found = client.lookup_and_lock(keys)  # pinned until unlocked: delete refuses them
    assert found.found == [True] * 4

    assert controller.evict(SIZE) == 0
    # one walk per victim (each refused one is skipped by the next), then one that
    # finds none left to try: each ended by an empty report
    assert policy.events == ["walk", []] * 5

    l2.unlock(keys)
    del policy.events[:]
    assert controller.evict(SIZE) == SIZE
    assert policy.events == ["walk", [keys[0]]]


def test_arc_takes_no_later_removal_for_the_eviction_of_a_walk_that_evicted_nothing(
    l1: L1Manager,
) -> None:
    policy = ARCEvictionPolicy()
    controller = evicting(l1, policy)
    keys = make_keys(4)
    stored(l1, keys)
    l1.reserve_read(keys)
    assert controller.evict_now(ALIGN) == 0  # ARC offered keys[0], which was locked
    l1.finish_read(keys)

    assert l1.delete([keys[0]]) == [True]  # gone for another reason: not an eviction

    assert keys[0] not in policy._recent_ghosts
    stored(l1, [keys[0]])
    assert keys[0] in policy._recent and policy._target == 0.0, "its return moves nothing"


class BrokenWalk(Recording):
    """A policy whose walk fails before offering anything (a third-party bug)."""

    def victims(self) -> Iterator[ObjectKey]:
        self.events.append("walk")
        raise RuntimeError("policy bug")


def test_a_walk_that_failed_before_evicting_is_ended_too_and_counted_once(l1: L1Manager) -> None:
    policy = BrokenWalk()
    controller = evicting(l1, policy)
    stored(l1, make_keys(4))

    assert controller.evict_now(ALIGN) == 0

    assert policy.events == ["walk", []]
    assert controller.stats.failures()["l1_eviction_policy_error"] == 1


class RefusesEmptyReports(Recording):
    """A policy that cannot take an empty removal report (a third-party bug)."""

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        super().on_keys_removed(keys)
        if not keys:
            raise ValueError("empty report")


def test_a_policy_failing_on_the_empty_report_is_counted(l1: L1Manager) -> None:
    policy = RefusesEmptyReports()
    controller = evicting(l1, policy)
    keys = make_keys(4)
    stored(l1, keys)
    l1.reserve_read(keys)

    assert controller.evict_now(ALIGN) == 0

    assert policy.events == ["walk", []]
    assert controller.stats.failures()["l1_eviction_policy_error"] == 1


#: how often the broken policy repeats its head before it gives up (finite, so that the
#: unbounded walk these tests guard against ends too, and a test fails rather than hangs)
REPEATS = 200_000
#: what a bounded walk offers at most here: a few keys, plus the bound's slack
BOUNDED = 1000


class RepeatsItsHead:
    """Offers its oldest key over and over, expecting the caller to remove it."""

    def __init__(self) -> None:
        self.order: dict[ObjectKey, None] = {}
        self.offered = 0

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self.order.update(dict.fromkeys(keys))

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            self.order.pop(key, None)

    def victims(self) -> Iterator[ObjectKey]:
        for _ in range(REPEATS):
            if not self.order:
                return
            self.offered += 1
            yield next(iter(self.order))


def test_an_l1_walk_repeating_a_locked_key_ends_and_is_counted(l1: L1Manager) -> None:
    policy = RepeatsItsHead()
    controller = evicting(l1, policy)
    keys = make_keys(4)
    stored(l1, keys)
    l1.reserve_read(keys[:1])  # the head cannot go

    assert controller.evict_now(ALIGN) == 0

    assert policy.offered < BOUNDED
    assert controller.stats.failures()["l1_eviction_policy_overrun"] == 1


def test_an_l2_walk_repeating_a_pinned_key_ends_and_is_counted(l2: BackendAdapter) -> None:
    policy = RepeatsItsHead()
    controller = evicting_l2(l2, policy)
    keys = make_keys(4)
    client = stored_in_l2(l2, keys)
    assert client.lookup_and_lock(keys[:1]).found == [True]  # pinned: delete refuses it

    assert controller.evict(SIZE) == 0

    assert policy.offered < BOUNDED
    assert controller.stats.failures()["l2_eviction_policy_overrun"] == 1
    l2.unlock(keys[:1])


class FailsRemovals(Fifo):
    """Fifo whose removal reports fail while ``broken`` (a third-party bug): the keys it
    was told about stay in its order, though L1 or the adapter no longer holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        if self.broken and keys:
            raise RuntimeError("policy bug")
        super().on_keys_removed(keys)


#: dead keys at the head of the broken policy's order: more than the walk's slack
DEAD = 80


def test_an_l1_walk_reaches_a_live_object_past_more_dead_keys_than_the_slack(l1: L1Manager) -> None:
    policy = FailsRemovals()
    controller = evicting(l1, policy)
    dead = make_keys(DEAD)
    for start in range(0, DEAD, 8):  # L1 holds 8 objects: written and deleted 8 at a time
        stored(l1, dead[start : start + 8])
        assert l1.delete(dead[start : start + 8]) == [True] * 8
    policy.broken = False
    live = [ObjectKey("walk-reports", 1, index.to_bytes(8, "big")) for index in range(4)]
    stored(l1, live)

    assert controller.evict_now(ALIGN) == ALIGN, "the walk skips the dead keys, as it did"
    assert not l1.contains(live[0])
    failures = controller.stats.failures()
    assert failures["l1_eviction_policy_error"] == DEAD // 8
    assert "l1_eviction_policy_overrun" not in failures


def test_an_l2_walk_reaches_a_live_object_past_more_dead_keys_than_the_slack(l2: BackendAdapter) -> None:
    policy = FailsRemovals()
    controller = evicting_l2(l2, policy)
    dead = make_keys(DEAD)
    for start in range(0, DEAD, 8):
        stored_in_l2(l2, dead[start : start + 8])
        assert l2.delete(dead[start : start + 8]) == [True] * 8
    policy.broken = False
    live = [ObjectKey("walk-reports", 1, index.to_bytes(8, "big")) for index in range(4)]
    stored_in_l2(l2, live)

    # (the dead keys' deletes free nothing, so the batches grow: more than one may go)
    assert controller.evict(SIZE) >= SIZE
    assert "l2_eviction_policy_overrun" not in controller.stats.failures()
