"""Victims an L1 eviction policy offers that L1 holds no evictable object of.

A policy hears of every key made READY and of every key removed, so a correct one offers
only keys L1 holds READY: some locked (read, or waiting for their L2 store), which L1
passes over as the protocol says.  A key L1 does not hold at all, or holds only as a
reservation being written, is a policy's bug (a key it kept after its removal, one it
made up): L1 skips it, which used to be silent.  Each is now counted
(``failures_total{reason="l1_eviction_policy_unknown_victim"}``) and logged once per burst.
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
REASON = "l1_eviction_policy_unknown_victim"


def make_keys(prefix: bytes, count: int) -> list[ObjectKey]:
    return [ObjectKey("unknown-victims", 0, prefix + index.to_bytes(4, "big")) for index in range(count)]


class OffersOthers(Fifo):
    """A Fifo whose walks offer ``extra`` keys first (a third-party bug)."""

    def __init__(self, extra: list[ObjectKey]) -> None:
        super().__init__()
        self.extra = extra

    def victims(self) -> Iterator[ObjectKey]:
        return iter([*self.extra, *self.order])


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(8 * ALIGN, align=ALIGN, prefault=False)
    yield manager
    manager.close()


def test_victims_l1_does_not_hold_or_holds_being_written_are_counted_and_logged_once(
    l1: L1Manager, caplog: pytest.LogCaptureFixture
) -> None:
    stored = make_keys(b"keep", 3)
    l1.reserve_write(stored, [ALIGN] * len(stored))
    l1.finish_write(stored)
    being_written = make_keys(b"writ", 1)
    l1.reserve_write(being_written, [ALIGN])
    unknown = make_keys(b"none", 2)
    policy = OffersOthers([*unknown, *being_written])
    policy.on_keys_written(stored)
    controller = L1EvictionController(
        l1, policy, trigger_watermark=0.9, eviction_ratio=0.5, stats=EngineStats(0)
    )

    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.controllers.l1_eviction"):
        assert controller.evict_now(ALIGN) == ALIGN
        assert controller.evict_now(ALIGN) == ALIGN

    assert controller.stats.failures()[REASON] == 6  # three skipped in each walk
    lines = [record.getMessage() for record in caplog.records if REASON in record.getMessage()]
    assert len(lines) == 1, lines
    assert l1.contains(being_written[0]), "a reservation being written is never evicted"


def test_locked_and_unstored_victims_are_not_counted_as_unknown(l1: L1Manager) -> None:
    keys = make_keys(b"lock", 4)
    l1.reserve_write(keys, [ALIGN] * len(keys))
    l1.finish_write(keys)
    l1.reserve_read(keys[:2])
    policy = Fifo()
    policy.on_keys_written(keys)
    controller = L1EvictionController(
        l1, policy, trigger_watermark=0.9, eviction_ratio=0.5, stats=EngineStats(0)
    )

    assert controller.evict_now(ALIGN) == ALIGN

    assert controller.stats.failures().get(REASON, 0) == 0


class OffersOneThenFails(Fifo):
    """Offers a key L1 does not hold, then raises (a third-party bug)."""

    def victims(self) -> Iterator[ObjectKey]:
        yield make_keys(b"none", 1)[0]
        raise RuntimeError("policy bug")


def test_victims_skipped_before_a_walk_failed_are_counted_too(l1: L1Manager) -> None:
    keys = make_keys(b"keep", 2)
    l1.reserve_write(keys, [ALIGN] * len(keys))
    l1.finish_write(keys)
    controller = L1EvictionController(
        l1, OffersOneThenFails(), trigger_watermark=0.9, eviction_ratio=0.5, stats=EngineStats(0)
    )

    assert controller.evict_now(ALIGN) == 0

    failures = controller.stats.failures()
    assert (failures[REASON], failures["l1_eviction_policy_error"]) == (1, 1)
