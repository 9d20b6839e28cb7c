"""An eviction round that leaves a tier above its trigger watermark is followed by another.

A burst of writes can fill a tier far past its watermark before its eviction thread runs;
freeing ``eviction_ratio`` of the used bytes once may then leave it still above.  The
controllers are driven by hand here (no thread), so each step is exactly one cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import pytest
from l2_backends import DictBackend, Fifo, open_dict

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot, PolicyFailureLog
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.testing.blocking import BlockingAdapterClient

ALIGN = 4096
BLOCKS = 64
WATERMARK = 0.8
RATIO = 0.1  # from a full tier, one round only gets down to 0.9


def make_keys(count: int) -> list[ObjectKey]:
    return [ObjectKey("rounds-model", 0, index.to_bytes(8, "big")) for index in range(count)]


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(BLOCKS * ALIGN, align=ALIGN, prefault=False)
    yield manager
    manager.close()


def test_l1_eviction_goes_on_until_usage_is_below_the_watermark(l1: L1Manager) -> None:
    controller = L1EvictionController(
        l1, Fifo(), trigger_watermark=WATERMARK, eviction_ratio=RATIO, stats=EngineStats(0)
    )
    keys = make_keys(BLOCKS)
    l1.reserve_write(keys, [ALIGN] * BLOCKS)
    l1.finish_write(keys)
    assert l1.usage() == 1.0

    controller.step(set())

    assert l1.usage() < WATERMARK
    evicted = controller.stats.snapshot()[0]["l1_evicted_keys"]
    assert evicted == BLOCKS - l1.stats().objects, "every eviction is counted"
    assert "l1_nothing_evictable" not in controller.stats.failures()


def test_l2_eviction_goes_on_until_usage_is_below_the_watermark() -> None:
    size = 1000
    adapter = open_dict(DictBackend, capacity=BLOCKS * size)
    try:
        config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=RATIO)
        controller = L2EvictionController(AdapterSlot(0, "dict", adapter), Fifo(), config, EngineStats(1))
        controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
        keys = make_keys(BLOCKS)
        client = BlockingAdapterClient(adapter)
        assert client.store(keys, [memoryview(bytearray(size)) for _ in keys]) == [True] * BLOCKS
        assert adapter.usage() == 1.0

        controller.step(set())

        assert adapter.usage() < WATERMARK
        evicted = controller.stats.adapter(0)["keys_evicted"]
        assert evicted == BLOCKS - len(list(adapter.iter_keys())), "every eviction is counted"
    finally:
        adapter.close()


class FailingMidWalk(Fifo):
    """A policy that breaks after offering one victim (a third-party bug)."""

    def victims(self) -> Iterator[ObjectKey]:
        yield next(super().victims())
        raise RuntimeError("policy bug")


def test_evictions_before_a_policy_failure_are_counted(l1: L1Manager) -> None:
    controller = L1EvictionController(
        l1, FailingMidWalk(), trigger_watermark=WATERMARK, eviction_ratio=RATIO, stats=EngineStats(0)
    )
    keys = make_keys(4)
    l1.reserve_write(keys, [ALIGN] * 4)
    l1.finish_write(keys)

    freed = controller.evict_now(2 * ALIGN)

    assert not l1.contains(keys[0]), "the victim offered before the failure is evicted"
    assert freed == ALIGN
    counters, _, failures = controller.stats.snapshot()
    assert failures["l1_eviction_policy_error"] == 1
    assert (counters["l1_evicted_keys"], counters["l1_evicted_bytes"]) == (1, ALIGN)


class FailingSecondWalk(Fifo):
    """A policy whose every walk but the first breaks (a third-party bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.walks = 0

    def victims(self) -> Iterator[ObjectKey]:
        self.walks += 1
        if self.walks > 1:
            raise RuntimeError("policy bug")
        return super().victims()


def test_l2_evictions_before_a_policy_failure_are_counted() -> None:
    size = 1000
    adapter = open_dict(DictBackend, capacity=BLOCKS * size)
    try:
        config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=RATIO)
        policy = FailingSecondWalk()
        controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))
        controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
        keys = make_keys(BLOCKS)
        client = BlockingAdapterClient(adapter)
        assert client.store(keys, [memoryview(bytearray(size)) for _ in keys]) == [True] * BLOCKS

        controller.evict(4 * size)  # the first walk deletes one key (sizes are learnt from it)

        stored = len(list(adapter.iter_keys()))
        assert stored < BLOCKS
        assert controller.stats.adapter(0)["keys_evicted"] == BLOCKS - stored
        assert controller.stats.failures()["l2_eviction_policy_error"] == 1
    finally:
        adapter.close()


class FailingOnOneKey(Fifo):
    """A policy that breaks whenever it is told about one key (a third-party bug)."""

    def __init__(self, poison: ObjectKey) -> None:
        super().__init__()
        self.poison = poison

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        if self.poison in keys:
            raise RuntimeError("policy bug")
        super().on_keys_written(keys)


def test_an_l1_policy_failing_on_a_write_is_counted(l1: L1Manager) -> None:
    keys = make_keys(BLOCKS)
    controller = L1EvictionController(
        l1, FailingOnOneKey(keys[-1]), trigger_watermark=WATERMARK, eviction_ratio=RATIO, stats=EngineStats(0)
    )
    l1.reserve_write(keys[:-1], [ALIGN] * (BLOCKS - 1))
    l1.finish_write(keys[:-1])
    l1.reserve_write(keys[-1:], [ALIGN])
    l1.finish_write(keys[-1:])

    assert controller.stats.failures()["l1_eviction_policy_error"] == 1


def test_l2_eviction_goes_on_after_the_policy_failed_on_the_stored_keys() -> None:
    size = 1000
    adapter = open_dict(DictBackend, capacity=BLOCKS * size)
    try:
        client = BlockingAdapterClient(adapter)
        before = make_keys(BLOCKS // 2)  # stored before the controller started
        assert client.store(before, [memoryview(bytearray(size)) for _ in before]) == [True] * len(before)
        config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=RATIO)
        policy = FailingOnOneKey(before[0])
        controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))

        controller.step(set())  # below the watermark: seeds the policy, which fails on the listing
        assert controller.stats.failures()["l2_eviction_policy_error"] == 1
        controller.step(set())  # the failure is not met again each cycle
        assert controller.stats.failures()["l2_eviction_policy_error"] == 1

        after = make_keys(BLOCKS)[BLOCKS // 2 :]
        assert client.store(after, [memoryview(bytearray(size)) for _ in after]) == [True] * len(after)
        assert adapter.usage() == 1.0
        controller.step(set())

        # the keys stored since are the policy's all the same, and evicted
        assert adapter.usage() < WATERMARK
        assert controller.stats.adapter(0)["keys_evicted"] > 0
        assert controller.stats.failures()["l2_eviction_policy_error"] == 1
    finally:
        adapter.close()


def test_l2_eviction_frees_something_when_a_round_rounds_down_to_no_bytes() -> None:
    # 10 one-byte objects at a ratio of 0.05: a round of int(10 * 0.05) = 0 bytes would
    # free nothing, and a tier above its watermark would refuse every store for good.
    adapter = open_dict(DictBackend, namespace="rounds-down", capacity=10)
    try:
        config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=0.05)
        controller = L2EvictionController(AdapterSlot(0, "dict", adapter), Fifo(), config, EngineStats(1))
        controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
        keys = make_keys(10)
        client = BlockingAdapterClient(adapter)
        assert client.store(keys, [memoryview(b"x") for _ in keys]) == [True] * 10
        assert adapter.usage() == 1.0

        controller.step(set())

        assert adapter.usage() < WATERMARK
    finally:
        adapter.close()


def test_l1_eviction_frees_something_when_a_round_rounds_down_to_no_bytes(l1: L1Manager) -> None:
    ratio = 1 / (2 * BLOCKS * ALIGN)  # int(used * ratio) is 0 for any usage of this arena
    controller = L1EvictionController(
        l1, Fifo(), trigger_watermark=WATERMARK, eviction_ratio=ratio, stats=EngineStats(0)
    )
    keys = make_keys(BLOCKS)
    l1.reserve_write(keys, [ALIGN] * BLOCKS)
    l1.finish_write(keys)

    controller.step(set())

    assert l1.usage() < WATERMARK
    assert "l1_nothing_evictable" not in controller.stats.failures()


class FailingOnEveryWrite(Fifo):
    """A policy that breaks whenever it is told about a store (a third-party bug)."""

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        raise RuntimeError("policy bug")


def test_an_l2_policy_failing_on_every_store_is_counted_each_time_and_logged_once_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every stored batch reaches the policy through the adapter's listener: a traceback
    # for each would bury the log under a steady store load; the counter has them all.
    adapter = open_dict(DictBackend, namespace="failing-writes", capacity=BLOCKS * 1000)
    try:
        config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=RATIO)
        controller = L2EvictionController(
            AdapterSlot(0, "dict", adapter), FailingOnEveryWrite(), config, EngineStats(1)
        )
        controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
        client = BlockingAdapterClient(adapter)
        batches = 5
        with caplog.at_level(logging.WARNING):
            for key in make_keys(batches):
                assert client.store([key], [memoryview(bytearray(1000))]) == [True]

        assert controller.stats.failures()["l2_eviction_policy_error"] == batches
        logged = [record for record in caplog.records if "eviction policy failed" in record.getMessage()]
        assert 1 <= len(logged) < batches, "one line per burst, not one per failure"
        assert logged[0].exc_info is not None, "the first failure is logged with its traceback"
    finally:
        adapter.close()


def test_an_l1_policy_failing_on_every_write_is_counted_each_time_and_logged_once_per_burst(
    l1: L1Manager, caplog: pytest.LogCaptureFixture
) -> None:
    # Every L1 write reaches the policy through the L1 listener: a traceback for each
    # would bury the log under a steady write load; the counter has them all.
    controller = L1EvictionController(
        l1, FailingOnEveryWrite(), trigger_watermark=WATERMARK, eviction_ratio=RATIO, stats=EngineStats(0)
    )
    writes = 5
    with caplog.at_level(logging.WARNING):
        for key in make_keys(writes):
            l1.reserve_write([key], [ALIGN])
            l1.finish_write([key])

    assert controller.stats.failures()["l1_eviction_policy_error"] == writes
    logged = [record for record in caplog.records if "eviction policy failed" in record.getMessage()]
    assert 1 <= len(logged) < writes, "one line per burst, not one per failure"
    assert logged[0].exc_info is not None, "the first failure is logged with its traceback"


def test_a_policy_failure_logged_without_its_traceback_still_names_the_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Only the first failure carries a traceback; a later, different bug of the same
    # policy must still be told apart in the one line its burst gets.
    log = PolicyFailureLog(logging.getLogger("test.policy"), "l2_eviction_policy_error")
    with caplog.at_level(logging.WARNING):
        for error in (RuntimeError("first bug"), KeyError("another bug")):
            try:
                raise error
            except Exception:
                log.failed("%s: eviction policy failed", "0:dict")

    later = [record for record in caplog.records if record.exc_info is None]
    assert len(later) == 1
    assert "KeyError" in later[0].getMessage() and "another bug" in later[0].getMessage()
