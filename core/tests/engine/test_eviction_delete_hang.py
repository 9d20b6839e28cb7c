"""L2 eviction while a backend's delete hangs (never returns).

A plain backend's ``delete_many`` is not bounded by ``call_timeout_s``: an eviction cycle
stuck in one would hold that adapter's eviction for good, uncounted.  The delete runs with
a deadline; past it the hang is counted and logged, the cycle ends, and the keys of that
delete stay in the policy (their records may well stay: they are never forgotten).  While
it still hangs no other delete piles up behind it -- cycles are skipped, counted -- and
once it ends, what it deleted leaves the policy and eviction goes on.
"""

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


class HangingDelete(DictBackend):
    """A dict whose deletes, once ``hanging`` is set, block until ``released`` is."""

    hanging = threading.Event()
    released = threading.Event()
    calls = 0  # deletes that reached the backend while hanging

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if HangingDelete.hanging.is_set():
            HangingDelete.calls += 1
            HangingDelete.released.wait()
        return super().delete_many(keys)


@pytest.fixture
def adapter() -> Iterator[BackendAdapter]:
    HangingDelete.hanging.clear()
    HangingDelete.released.clear()
    HangingDelete.calls = 0
    opened = open_dict(HangingDelete, capacity=OBJECTS * SIZE)
    try:
        yield opened
    finally:
        HangingDelete.released.set()  # a delete left hanging ends
        opened.close()


def test_a_hanging_delete_is_counted_and_its_keys_stay_accounted(
    adapter: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_of("m", OBJECTS)
    store_blank(adapter, keys, SIZE)
    policy = Fifo()
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    controller = L2EvictionController(AdapterSlot(0, "hanging", adapter), policy, config, EngineStats(1))
    controller.delete_deadline_s = 0.5
    HangingDelete.hanging.set()

    assert step_returns(controller), "a cycle does not wait for a delete that never returns"
    failures = controller.stats.failures()
    assert failures["l2_eviction_delete_timeout"] == 1
    assert HangingDelete.calls == 1
    assert list(policy.order) == keys, "the keys of the hung delete are not forgotten"
    assert adapter.usage() == 1.0

    assert step_returns(controller)
    assert HangingDelete.calls == 1, "no second delete piles up behind the hung one"
    failures = controller.stats.failures()
    assert failures["l2_eviction_delete_timeout"] == 1, "one hang, counted once"
    assert failures["l2_eviction_skipped_delete_hung"] == 1
    logged = [r for r in caplog.records if "has not returned" in r.getMessage() and r.levelname == "WARNING"]
    assert len(logged) == 1

    HangingDelete.hanging.clear()
    HangingDelete.released.set()
    join_left_running(controller, "delete")
    assert keys[0] not in policy.order, "what the late delete removed left the policy"
    assert step_returns(controller)
    assert adapter.usage() < 0.8, "eviction goes on once the delete ended"
