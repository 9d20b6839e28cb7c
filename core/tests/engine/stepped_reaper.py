"""The L1 eviction controller driven by hand (no thread) on a clock the test alone moves:
when a reap runs is then decided by the controller's schedule, never by how busy the
machine is."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from l2_backends import Fifo

from lmcache_tiers.controllers import l1_eviction
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.l1 import L1Manager


class SteppedClock:
    """The eviction controller's monotonic clock."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


@contextmanager
def stepped_reaper(
    monkeypatch: pytest.MonkeyPatch, l1: L1Manager
) -> Iterator[tuple[L1Manager, L1EvictionController, SteppedClock]]:
    """``l1`` and its eviction controller on a stepped clock that starts on a whole second
    (so that reaps a fraction of a second apart fall exactly on its steps); both are closed
    on the way out."""
    clock = SteppedClock(float(math.ceil(time.monotonic())))
    monkeypatch.setattr(l1_eviction, "time", clock)
    controller = L1EvictionController(
        l1, Fifo(), trigger_watermark=0.99, eviction_ratio=0.1, stats=EngineStats(0)
    )
    try:
        yield l1, controller, clock
    finally:
        controller.finish()
        l1.close()
