"""An L1 eviction round that evicts objects whose extents are held back for an expired
lock's grace period frees nothing yet, but it is no round that found nothing evictable:
``l1_nothing_evictable`` and its WARNING are for rounds that could evict nothing at all.

The controller is driven by hand (no thread), so each step is exactly one cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from l2_backends import Fifo

from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

ALIGN = 4096
BLOCKS = 10
STORED = 9  # 90 % usage: above the watermark
WATERMARK = 0.8
RATIO = 0.1  # one round asks for less than one object's bytes
LOCK_TTL = 30.0
GRACE = 5.0


def make_keys(count: int) -> list[ObjectKey]:
    return [ObjectKey("held-back-model", 0, index.to_bytes(8, "big")) for index in range(count)]


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(
        BLOCKS * ALIGN,
        align=ALIGN,
        lock_ttl_s=LOCK_TTL,
        write_ttl_s=LOCK_TTL,
        prefault=False,
        lease_grace_s=GRACE,
    )
    yield manager
    manager.close()


def stuck_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if "L1 eviction round evicted nothing" in record.getMessage()]


def test_a_round_evicting_only_held_back_extents_is_not_counted_as_nothing_evictable(
    l1: L1Manager, caplog: pytest.LogCaptureFixture
) -> None:
    controller = L1EvictionController(
        l1,
        Fifo(),
        trigger_watermark=WATERMARK,
        eviction_ratio=RATIO,
        stats=EngineStats(0),
        reap_interval_s=3600.0,  # no reap during the step: the test reaps by hand
    )
    keys = make_keys(STORED)
    l1.reserve_write(keys, [ALIGN] * STORED)
    assert all(l1.finish_write(keys))
    # The first object's reader outlived its lock: the lock is reaped, and the object's
    # extent is held back for the grace period once it leaves L1.
    l1.reserve_read(keys[:1])
    first = l1.get(keys[0])
    assert first is not None
    assert l1.expire_locks(first.lock_deadline + 1) == 1
    # Every other object is locked by a reader in time.
    l1.reserve_read(keys[1:])

    with caplog.at_level(logging.WARNING):
        controller.step(set())

    assert not l1.contains(keys[0]), "the unlocked object is evicted"
    assert l1.used_bytes == STORED * ALIGN, "its extent is held back: nothing freed yet"
    counters, _, failures = controller.stats.snapshot()
    assert counters["l1_evicted_keys"] == 1
    assert "l1_nothing_evictable" not in failures, "the round evicted an object"
    assert stuck_warnings(caplog) == []

    # The next round has nothing left to evict: that one is counted, and logged.
    with caplog.at_level(logging.WARNING):
        controller.step(set())

    assert controller.stats.failures()["l1_nothing_evictable"] == 1
    assert len(stuck_warnings(caplog)) == 1
    l1.finish_read(keys[1:])
