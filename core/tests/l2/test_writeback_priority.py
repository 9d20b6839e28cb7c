"""Write-back runs as background work: store threads at the lowest CPU priority, and the
GIL handed over quickly while the store controller runs."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest
from l2_backends import open_dict

from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.controllers.store import GIL_SWITCH_S, StoreController
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l2.runners import WRITE_BACK_NICE
from lmcache_tiers.policies import StorePolicy


def nice_of(thread: threading.Thread) -> int:
    """The thread's nice value, from /proc (field 19 of its stat line)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[16])


@pytest.fixture
def switch_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc for thread priorities")
def test_store_threads_run_at_the_lowest_priority_and_the_others_do_not() -> None:
    adapter = open_dict()
    try:
        workers = {t.name: t for t in threading.enumerate() if t.name.startswith("l2-0:t-")}
        stores = [t for name, t in workers.items() if "-store-" in name]
        others = [t for name, t in workers.items() if "-store-" not in name]
        assert stores and others
        assert {nice_of(t) for t in stores} == {max(os.nice(0), WRITE_BACK_NICE)}
        assert {nice_of(t) for t in others} == {os.nice(0)}
    finally:
        adapter.close()


class _Everywhere(StorePolicy):
    def select_store_targets(self, keys, adapters):  # type: ignore[no-untyped-def]
        return {adapter.index: list(keys) for adapter in adapters}

    def select_l1_deletions(self, keys):  # type: ignore[no-untyped-def]
        return []


def test_the_store_controller_shortens_the_gil_switch_interval_only_with_adapters(
    switch_interval: float,
) -> None:
    sys.setswitchinterval(0.005)
    l1 = L1Manager(16 << 20, prefault=False)
    try:
        idle = StoreController(l1, [], _Everywhere(), EngineStats(0))
        idle.start()
        idle.stop()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        adapter = open_dict()
        try:
            busy = StoreController(l1, [AdapterSlot(0, "dict", adapter)], _Everywhere(), EngineStats(0))
            busy.start()
            busy.stop()
            assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
        finally:
            adapter.close()
    finally:
        l1.close()
