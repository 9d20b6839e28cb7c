"""Every walk of a policy's ``victims()`` is followed by one removal report -- an empty one
when the walk removed nothing -- so a policy that remembers what a walk offered (ARC)
never takes a later removal for another reason (a client's delete, a temporary prefetch
freed after its read) for that walk's eviction."""

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


def test_an_l2_walk_whose_victims_are_all_pinned_is_ended_by_an_empty_report() -> None:
    adapter = open_dict(DictBackend, capacity=8 * SIZE)
    try:
        policy = Recording()
        config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.5)
        controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))
        controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
        keys = make_keys(4)
        client = BlockingAdapterClient(adapter)
        assert client.store(keys, [memoryview(bytearray(SIZE)) for _ in keys]) == [True] * 4
        found = client.lookup_and_lock(keys)  # pinned until unlocked: delete refuses them
        assert found.found == [True] * 4

        assert controller.evict(SIZE) == 0
        # one walk per victim (each refused one is skipped by the next), then one that
        # finds none left to try: each ended by an empty report
        assert policy.events == ["walk", []] * 5

        adapter.unlock(keys)
        del policy.events[:]
        assert controller.evict(SIZE) == SIZE
        assert policy.events == ["walk", [keys[0]]]
    finally:
        adapter.close()


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
