"""A walk of ``victims()`` is bounded: a policy that offers the same keys again and again
(a third-party bug: one that waits for the caller to remove its head, which is locked)
must not hold the L1 lock, or an L2 adapter's listeners, for ever.  A correct policy offers
each key it holds once per walk, so the bound never cuts one short; the walk that hits it
ends, counted and logged."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from l2_backends import DictBackend, open_dict

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.testing.blocking import BlockingAdapterClient

ALIGN = 4096
SIZE = 1000
#: how often the broken policy repeats its head before it gives up (finite, so that the
#: unbounded walk this test guards against ends too, and the test fails rather than hangs)
REPEATS = 200_000
#: what a bounded walk offers at most here: a few keys, plus the bound's slack
BOUNDED = 1000


def make_keys(count: int) -> list[ObjectKey]:
    return [ObjectKey("walk-bounds", 0, index.to_bytes(8, "big")) for index in range(count)]


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


def test_an_l1_walk_repeating_a_locked_key_ends_and_is_counted() -> None:
    l1 = L1Manager(8 * ALIGN, align=ALIGN, prefault=False)
    try:
        policy = RepeatsItsHead()
        controller = L1EvictionController(
            l1, policy, trigger_watermark=0.9, eviction_ratio=0.5, stats=EngineStats(0)
        )
        keys = make_keys(4)
        l1.reserve_write(keys, [ALIGN] * len(keys))
        l1.finish_write(keys)
        l1.reserve_read(keys[:1])  # the head cannot go

        assert controller.evict_now(ALIGN) == 0

        assert policy.offered < BOUNDED
        assert controller.stats.failures()["l1_eviction_policy_overrun"] == 1
    finally:
        l1.close()


def test_an_l2_walk_repeating_a_pinned_key_ends_and_is_counted() -> None:
    adapter = open_dict(DictBackend, capacity=8 * SIZE)
    try:
        policy = RepeatsItsHead()
        config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.5)
        controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))
        controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
        keys = make_keys(4)
        client = BlockingAdapterClient(adapter)
        assert client.store(keys, [memoryview(bytearray(SIZE)) for _ in keys]) == [True] * 4
        assert client.lookup_and_lock(keys[:1]).found == [True]  # pinned: delete refuses it

        assert controller.evict(SIZE) == 0

        assert policy.offered < BOUNDED
        assert controller.stats.failures()["l2_eviction_policy_overrun"] == 1
        adapter.unlock(keys[:1])
    finally:
        adapter.close()
