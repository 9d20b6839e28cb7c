"""L2 eviction knows every key the adapter's start-up scan accounted.

The scan and the eviction controller's seeding each list the store.  A key stored (by
another server sharing the store) after the seeding listing and before the scan's listing
reads it is accounted by the scan, so it counts in this adapter's usage; if the policy
never heard of it, this server could never evict it, and with a capacity the usage would
stay above the watermark, refusing stores for good.  The scan announces what it accounts
(``on_l2_keys_scanned``), and the policy learns each key once: a key it already had from
the listing is not written twice (a second write reads as a second use).
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence

import pytest
from l2_backends import CYCLE_BOUND_S, DictBackend, Fifo, keys_of, open_dict

import lmcache_tiers.l2.scan as scan_module
from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter

SIZE = 1000
OBJECTS = 10
BEFORE_START = 2  # listed by both; the rest is stored between the two listings
WATERMARK = 0.8


class ScanListsLast(DictBackend):
    """A dict whose first listing (the adapter's start-up scan) reads the dict only once
    ``released`` is set, so that the scan's listing can be sequenced after another one."""

    released = threading.Event()
    first_listing_taken = False

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        if ScanListsLast.first_listing_taken:
            return iter(super().list_keys())
        ScanListsLast.first_listing_taken = True
        return self._after_release()

    def _after_release(self) -> Iterator[tuple[ObjectKey, int]]:
        assert ScanListsLast.released.wait(CYCLE_BOUND_S), "the test never released the scan"
        yield from super().list_keys()


class CountingFifo(Fifo):
    """Oldest write first, counting how often each key was written."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: Counter[ObjectKey] = Counter()

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self.writes.update(keys)
        super().on_keys_written(keys)


@pytest.fixture
def adapter(monkeypatch: pytest.MonkeyPatch) -> Iterator[BackendAdapter]:
    ScanListsLast.released = threading.Event()
    ScanListsLast.first_listing_taken = False
    # The whole scan on its thread, so that its listing runs after the controller's.
    monkeypatch.setattr(scan_module, "FOREGROUND_ENTRIES", 0)
    # A namespace of its own: the dicts outlive a test, and an id() is reused by the next
    # test's fixture as soon as this one's object is freed, which then saw these keys.
    namespace = f"scan-seed-{uuid.uuid4().hex}"
    opened = open_dict(ScanListsLast, namespace=namespace, capacity=OBJECTS * SIZE)
    yield opened
    ScanListsLast.released.set()
    opened.close()


def another_server_stores(adapter: BackendAdapter, keys: Sequence[ObjectKey]) -> None:
    """Writes ``keys`` straight into the shared store, as another server would."""
    backend = adapter.backend
    assert isinstance(backend, DictBackend)
    with backend.lock:
        for key in keys:
            backend.objects[key] = bytes(SIZE)


def wait_for_scan(adapter: BackendAdapter) -> None:
    ScanListsLast.released.set()
    thread = adapter.scan._thread
    assert thread is not None, "the scan ran on its thread"
    thread.join(CYCLE_BOUND_S)
    assert adapter.stats()["scan_running"] == 0


def test_keys_the_scan_accounted_after_the_seeding_listing_can_be_evicted(adapter: BackendAdapter) -> None:
    early = keys_of("before-start", BEFORE_START)
    another_server_stores(adapter, early)
    policy = CountingFifo()
    config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=0.5)
    controller = L2EvictionController(AdapterSlot(0, "shared", adapter), policy, config, EngineStats(1))
    assert adapter.stats()["scan_running"] == 1, "the scan waits for its listing"

    controller.step(set())  # seeds the policy from its own listing: the early keys only
    assert list(policy.order) == early
    between = keys_of("between-listings", OBJECTS - BEFORE_START)
    another_server_stores(adapter, between)
    wait_for_scan(adapter)  # the scan lists last: it accounts every key
    assert adapter.usage() == 1.0

    controller.step(set())

    assert adapter.usage() < WATERMARK, "keys the scan accounted are evicted too: not full for good"
    assert max(policy.writes.values()) == 1, "each key reached the policy once"
    assert set(policy.writes) == set(early) | set(between)


def test_keys_the_scan_announced_before_seeding_join_the_policy_once(adapter: BackendAdapter) -> None:
    stored = keys_of("before-start", OBJECTS)
    another_server_stores(adapter, stored)
    policy = CountingFifo()
    config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=0.5)
    controller = L2EvictionController(AdapterSlot(0, "shared", adapter), policy, config, EngineStats(1))
    wait_for_scan(adapter)  # announced while the policy is not seeded yet

    controller.step(set())  # the listing brings the same keys

    assert policy.writes == Counter(dict.fromkeys(stored, 1)), "listed and scanned: written once"
    assert adapter.usage() < WATERMARK


def test_an_adapter_whose_stats_raises_frees_the_kept_listing(
    adapter: BackendAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    another_server_stores(adapter, keys_of("before-start", BEFORE_START))
    asked = 0

    def stats_that_raise() -> dict[str, int]:
        nonlocal asked
        asked += 1
        raise RuntimeError("stats unavailable")

    monkeypatch.setattr(adapter, "stats", stats_that_raise)
    config = L2EvictionConfig(trigger_watermark=WATERMARK)
    controller = L2EvictionController(
        AdapterSlot(0, "shared", adapter), CountingFifo(), config, EngineStats(1)
    )

    for _ in range(3):
        controller.step(set())

    assert asked == 1, "a scan state that cannot be read is asked once, not every cycle"
    assert controller.stats.failures()["l2_eviction_scan_state_error"] == 1
