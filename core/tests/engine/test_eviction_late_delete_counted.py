"""An L2 eviction delete that returns after its deadline still evicted what it deleted:
the cycle that gave up on it counted nothing of it, so its keys are counted in
``keys_evicted`` when it returns -- once, and not again by the cycles after it."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
from l2_backends import DictBackend, Fifo, join_left_running, keys_of, open_dict, step_returns, store_blank

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter

SIZE = 1000
OBJECTS = 100


class LateDelete(DictBackend):
    """A dict whose deletes, once ``holding`` is set, wait until ``released`` is."""

    holding = threading.Event()
    released = threading.Event()

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if LateDelete.holding.is_set():
            LateDelete.released.wait()
        return super().delete_many(keys)


@pytest.fixture
def adapter() -> Iterator[BackendAdapter]:
    LateDelete.holding.clear()
    LateDelete.released.clear()
    opened = open_dict(LateDelete, capacity=OBJECTS * SIZE)
    try:
        yield opened
    finally:
        LateDelete.released.set()
        opened.close()


def test_the_keys_of_a_delete_returning_past_its_deadline_count_as_evicted(adapter: BackendAdapter) -> None:
    keys = keys_of("late", OBJECTS)
    store_blank(adapter, keys, SIZE)
    policy = Fifo()
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    stats = EngineStats(1)
    controller = L2EvictionController(AdapterSlot(0, "late", adapter), policy, config, stats)
    controller.delete_deadline_s = 0.0  # the held delete cannot have returned by then
    LateDelete.holding.set()

    assert step_returns(controller)
    assert stats.failures()["l2_eviction_delete_timeout"] == 1
    assert stats.adapter(0)["keys_evicted"] == 0, "nothing deleted yet"

    LateDelete.holding.clear()
    LateDelete.released.set()
    join_left_running(controller, "delete")
    assert keys[0] not in policy.order, "the late delete removed its key"
    assert stats.adapter(0)["keys_evicted"] == 1, "its key was evicted: counted when it returned"

    before = adapter.usage()
    assert step_returns(controller)
    freed_keys = round((before - adapter.usage()) * OBJECTS)
    assert freed_keys > 0, "eviction goes on once the delete returned"
    assert stats.adapter(0)["keys_evicted"] == 1 + freed_keys, "the late delete is counted once"
