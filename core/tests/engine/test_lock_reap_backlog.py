"""A mass expiry reaped a bounded pass at a time is finished by passes that follow at once.

A reap pass looks at ``REAP_BATCH`` objects at most (``l1/removal.py``), so that a client
that died holding 100k locks does not hold the L1 lock for 110-200 ms in one pass; the
eviction controller then runs the next pass as soon as the last one's cost allows, not a
reap interval later (under long TTLs, 5 s a pass).  The controller's clock is stepped by
the test alone, and a pass costs no time on it: the passes must come without it moving.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from stepped_reaper import SteppedClock, stepped_reaper

from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1.removal import REAP_BATCH
from lmcache_tiers.sweep_cadence import SWEEP_FLOOR_S

ALIGN = 512
TTL_S = 60.0
MASS = 2 * REAP_BATCH + 1  # three passes


@pytest.fixture
def stepped(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[L1Manager, L1EvictionController, SteppedClock]]:
    l1 = L1Manager(2 * MASS * ALIGN, align=ALIGN, prefault=False, lock_ttl_s=TTL_S, write_ttl_s=TTL_S)
    with stepped_reaper(monkeypatch, l1) as reaper:
        yield reaper


def test_the_passes_after_one_that_stopped_at_its_budget_come_at_once(stepped) -> None:
    l1, controller, clock = stepped
    keys = [ObjectKey("backlog", 0, index.to_bytes(8, "big")) for index in range(MASS)]
    reserved = l1.reserve_write(keys, [ALIGN] * MASS)
    assert all(l1.finish_write_and_reserve_read(keys))  # a client that dies holding them
    clock.now = max(obj.lock_deadline for obj in reserved.values())
    controller._next_reap = clock.now  # the regular reap comes due
    controller.step(set())
    assert l1.stats().read_locks == MASS - REAP_BATCH and l1.reap_backlog
    passes = 1
    while l1.reap_backlog:
        assert controller.next_step_in() == 0.0, "the rest waits for the regular interval"
        controller.step(set())
        passes += 1
    assert passes == 3 and l1.stats().read_locks == 0
    assert controller.stats.failures()["l1_lock_expired"] == MASS
    # The backlog done, the regular cadence again.
    assert controller.next_step_in() >= SWEEP_FLOOR_S
