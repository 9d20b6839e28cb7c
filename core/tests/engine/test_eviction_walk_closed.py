"""An eviction policy's walk (its ``victims()`` generator) is closed by the eviction,
under the lock that guards the policy (L2: the policy lock; L1: the L1 lock) and as plugin
code: never left to the garbage collector, whose closing would run the policy's cleanup
with no lock held and swallow what it raised."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from l2_backends import DictBackend, Fifo, open_dict

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient

SIZE = 1000
BLOCKS = 16


def make_keys(count: int) -> list[ObjectKey]:
    return [ObjectKey("walk-closed", 0, index.to_bytes(8, "big")) for index in range(count)]


class CleaningUpWalk(Fifo):
    """A policy whose walk has cleanup (a generator's ``finally``): it records whether the
    policy lock was held, and raises ``failure`` if given."""

    def __init__(self, failure: BaseException | None = None) -> None:
        super().__init__()
        self.failure = failure
        self.lock: threading.Lock | None = None
        self.cleanups: list[bool] = []  # whether the policy lock was held, per walk ended

    def lock_held(self) -> bool:
        assert self.lock is not None
        return self.lock.locked()

    def victims(self) -> Iterator[ObjectKey]:
        try:
            yield from list(self.order)
        finally:
            self.cleanups.append(self.lock_held())
            if self.failure is not None:
                raise self.failure


def filled(policy: CleaningUpWalk) -> tuple[BackendAdapter, L2EvictionController]:
    adapter = open_dict(DictBackend, capacity=BLOCKS * SIZE)
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.5)
    controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))
    policy.lock = controller._policy_lock
    controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
    keys = make_keys(BLOCKS)
    client = BlockingAdapterClient(adapter)
    assert client.store(keys, [memoryview(bytearray(SIZE)) for _ in keys]) == [True] * BLOCKS
    return adapter, controller


def test_a_walk_cut_short_is_closed_under_the_policy_lock() -> None:
    policy = CleaningUpWalk()
    adapter, controller = filled(policy)
    try:
        assert controller.evict(2 * SIZE) > 0
        assert policy.cleanups and all(policy.cleanups), policy.cleanups
    finally:
        adapter.close()


def test_a_walk_whose_cleanup_raises_is_a_counted_policy_failure() -> None:
    policy = CleaningUpWalk(RuntimeError("a bug in the policy's cleanup"))
    adapter, controller = filled(policy)
    try:
        controller.evict(2 * SIZE)
        assert controller.stats.failures().get("l2_eviction_policy_error", 0) >= 1
    finally:
        adapter.close()


def test_a_walk_whose_cleanup_exits_off_the_main_thread_is_a_counted_policy_failure() -> None:
    """A SystemExit from the policy's cleanup on the controller's thread is the plugin's
    failure (plugin code), counted -- not swallowed by the garbage collector."""
    policy = CleaningUpWalk(SystemExit("a policy calling sys.exit in its cleanup"))
    adapter, controller = filled(policy)
    try:
        cycle = threading.Thread(target=controller.evict, args=(2 * SIZE,))
        cycle.start()
        cycle.join(30.0)
        assert not cycle.is_alive()
        assert controller.stats.failures().get("l2_eviction_policy_error", 0) >= 1
    finally:
        adapter.close()


ALIGN = 4096


class CleaningUpL1Walk(CleaningUpWalk):
    """:class:`CleaningUpWalk` for L1, whose policy is guarded by the L1 lock (an RLock:
    held means held by the thread running the cleanup)."""

    def __init__(self, l1: L1Manager, failure: BaseException | None = None) -> None:
        super().__init__(failure)
        self.l1 = l1

    def lock_held(self) -> bool:
        return bool(self.l1.lock._is_owned())  # type: ignore[attr-defined]


def l1_filled(
    policy_for: type[CleaningUpL1Walk], failure: BaseException | None = None
) -> tuple[L1Manager, CleaningUpL1Walk, L1EvictionController]:
    l1 = L1Manager(BLOCKS * ALIGN, align=ALIGN, prefault=False)
    policy = policy_for(l1, failure)
    controller = L1EvictionController(
        l1, policy, trigger_watermark=1.0, eviction_ratio=0.5, stats=EngineStats(0)
    )
    keys = make_keys(BLOCKS // 2)
    l1.reserve_write(keys, [ALIGN] * len(keys))
    l1.finish_write(keys)
    return l1, policy, controller


def test_an_l1_walk_cut_short_is_closed_under_the_l1_lock() -> None:
    l1, policy, controller = l1_filled(CleaningUpL1Walk)
    try:
        assert controller.evict_now(ALIGN) == ALIGN  # the walk is cut short after one key
        assert policy.cleanups == [True], policy.cleanups
    finally:
        l1.close()


def test_an_l1_walk_whose_cleanup_raises_is_a_counted_policy_failure() -> None:
    l1, policy, controller = l1_filled(CleaningUpL1Walk, RuntimeError("a bug in the policy's cleanup"))
    try:
        assert controller.evict_now(ALIGN) == ALIGN, "what the walk offered is evicted all the same"
        assert controller.stats.failures().get("l1_eviction_policy_error", 0) == 1
        assert controller.stats.get("l1_evicted_keys") == 1
        assert policy.cleanups == [True]
    finally:
        l1.close()


def test_an_l1_walk_whose_cleanup_exits_off_the_main_thread_is_a_counted_policy_failure() -> None:
    l1, policy, controller = l1_filled(CleaningUpL1Walk, SystemExit("sys.exit in the policy's cleanup"))
    try:
        freed: list[int] = []
        evicting = threading.Thread(target=lambda: freed.append(controller.evict_now(ALIGN)))
        evicting.start()
        evicting.join(30.0)
        assert freed == [ALIGN], "the eviction returned, its thread not ended by the policy"
        assert policy.cleanups == [True]
        assert controller.stats.failures().get("l1_eviction_policy_error", 0) == 1
    finally:
        l1.close()
