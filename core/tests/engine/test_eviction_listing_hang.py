"""L2 eviction while listing the keys stored before start-up hangs (never returns).

A backend that stops answering rather than failing must not hold the eviction cycles: the
listing runs on a thread of its own with a deadline.  Past it, the hang is counted and
logged, and the keys stored since (which the policy hears of as they are stored) are
evicted meanwhile -- a store filled by them would otherwise refuse stores for good,
silently.  The listing seeds the policy if it ever ends; shutdown never waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from l2_backends import (
    CYCLE_BOUND_S,
    DictBackend,
    Fifo,
    join_left_running,
    keys_of,
    open_dict,
    step_returns,
    store_blank,
)

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter

SIZE = 1000
OBJECTS = 200
BEFORE_START = 150  # below the watermark: the stores after start-up fill the store


class HangingListing(DictBackend):
    """A dict whose listing, once ``hanging`` is set, blocks until ``released`` is."""

    hanging = threading.Event()
    entered = threading.Event()  # a listing is blocked
    released = threading.Event()
    fails_when_released = False  # as a listing that the adapter's close cuts short
    lists_at_entry = False  # returns the keys stored when it was entered, as a slow scan

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        listed = super().list_keys()
        if HangingListing.hanging.is_set():
            HangingListing.entered.set()
            HangingListing.released.wait()
            if HangingListing.fails_when_released:
                raise ConnectionError("listing cut short")
        return listed if HangingListing.lists_at_entry else super().list_keys()


@pytest.fixture
def adapter() -> Iterator[BackendAdapter]:
    for event in (HangingListing.hanging, HangingListing.entered, HangingListing.released):
        event.clear()
    HangingListing.fails_when_released = HangingListing.lists_at_entry = False
    opened = open_dict(HangingListing, capacity=OBJECTS * SIZE)
    try:
        yield opened
    finally:
        HangingListing.released.set()  # a listing thread left hanging ends
        opened.close()


def started_with_a_hanging_listing(adapter: BackendAdapter) -> tuple[L2EvictionController, Fifo]:
    store_blank(adapter, keys_of("before-start", BEFORE_START), SIZE)
    assert adapter.stats()["scan_running"] == 0  # the adapter's own start-up scan is done
    HangingListing.hanging.set()
    policy = Fifo()
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    controller = L2EvictionController(AdapterSlot(0, "hanging", adapter), policy, config, EngineStats(1))
    return controller, policy


def test_a_hanging_listing_is_counted_and_keys_stored_since_are_evicted(
    adapter: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    controller, policy = started_with_a_hanging_listing(adapter)
    controller.listing_deadline_s = 0.0  # past its deadline as soon as it starts
    assert step_returns(controller), "a cycle does not wait for a listing that never ends"
    assert controller.stats.failures()["l2_eviction_listing_timeout"] == 1

    fresh = keys_of("after-start", OBJECTS - BEFORE_START)
    store_blank(adapter, fresh, SIZE)
    assert adapter.usage() == 1.0
    assert list(policy.order) == fresh, "stores reach the policy while the listing hangs"

    assert step_returns(controller)
    assert adapter.usage() < 0.8, "the keys stored since are evicted: the store is not full for good"
    assert controller.stats.failures()["l2_eviction_listing_timeout"] == 1, "one hang, counted once"
    logged = [r for r in caplog.records if "has not ended" in r.getMessage() and r.levelname == "WARNING"]
    assert len(logged) == 1

    HangingListing.released.set()
    join_left_running(controller, "listing")
    survivors = [key for key in fresh if key in policy.order]
    assert list(policy.order) == survivors + keys_of("before-start", BEFORE_START), (
        "the listing that ends late adds the keys stored before start-up"
    )


def test_shutdown_does_not_wait_for_a_hanging_listing(adapter: BackendAdapter) -> None:
    controller, _policy = started_with_a_hanging_listing(adapter)
    controller.start()  # its first cycle waits for the listing, up to the deadline
    assert HangingListing.entered.wait(CYCLE_BOUND_S)
    assert controller.stop(drain_timeout_s=0.0), "the thread ends though the listing hangs"


def test_two_cycles_waiting_for_one_hanging_listing_count_it_once(adapter: BackendAdapter) -> None:
    """The thread's cycle and a direct evict() both wait for the same listing: its hang is
    one hang, counted and logged once, whichever reaches the deadline second."""
    controller, _policy = started_with_a_hanging_listing(adapter)
    controller.listing_deadline_s = 2.0  # both are waiting by then
    direct = threading.Thread(target=controller.evict, args=(0,), daemon=True)
    direct.start()
    assert HangingListing.entered.wait(CYCLE_BOUND_S)
    assert step_returns(controller)
    direct.join(CYCLE_BOUND_S)
    assert not direct.is_alive()
    assert controller.stats.failures()["l2_eviction_listing_timeout"] == 1


def test_a_listing_cut_short_by_shutdown_is_no_failed_listing(
    adapter: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    """After the controller stopped, the listing it left hanging ends when the adapter is
    closed: nothing will retry it, and it is no backend failure to count or warn of."""
    controller, _policy = started_with_a_hanging_listing(adapter)
    controller.listing_deadline_s = 0.0
    controller.start()
    assert HangingListing.entered.wait(CYCLE_BOUND_S)
    assert controller.stop(drain_timeout_s=0.0)
    HangingListing.fails_when_released = True
    HangingListing.released.set()
    join_left_running(controller, "listing")
    assert controller.stats.failures().get("l2_eviction_scan_error", 0) == 0
    assert not [r for r in caplog.records if "failed" in r.getMessage() and r.levelname == "WARNING"]


def test_keys_removed_while_a_listing_hangs_are_remembered_up_to_a_bound(adapter: BackendAdapter) -> None:
    """While a listing hangs, the keys removed meanwhile are remembered so that it does not
    add them back if it ends; evictions of ever new keys must not grow that record without
    bound.  Past its bound they are forgotten (counted), and the listing still seeds the
    policy when it ends: a key it lists that was removed meanwhile leaves the policy when
    offered, found absent, not a failed delete."""
    HangingListing.lists_at_entry = True  # what it lists predates the removals below
    controller, policy = started_with_a_hanging_listing(adapter)
    controller.listing_deadline_s = 0.0
    controller.removed_while_listing_max = 20
    assert step_returns(controller)  # the hang is past its deadline: events go live
    assert HangingListing.entered.wait(CYCLE_BOUND_S)

    before_start = keys_of("before-start", BEFORE_START)
    removed = before_start[:5]
    assert all(adapter.delete(removed))
    for round_number in range(10):  # store and delete ever new keys: traffic, not objects
        churned = keys_of(f"churn-{round_number}", 10)
        store_blank(adapter, churned, SIZE)
        assert all(adapter.delete(churned))
    assert len(controller._removed_while_listing) <= 20, "removals while a listing hangs grow without bound"
    assert controller.stats.failures()["l2_eviction_listing_removals_forgotten"] == 1

    HangingListing.released.set()
    join_left_running(controller, "listing")
    assert set(before_start[5:]) <= set(policy.order), "the listing seeds the policy all the same"
    assert not any(key.model_name.startswith("churn") for key in policy.order)

    # A removed key it listed: offered, found absent by the adapter, gone from the policy.
    phantoms = [key for key in removed if key in policy.order]
    assert phantoms, "the listing predates the removals"
    assert not any(adapter.delete(phantoms))
    assert not any(key in policy.order for key in phantoms)
    assert adapter.stats()["delete_keys_absent"] == len(phantoms)
    assert controller.stats.failures().get("l2_eviction_delete_failed", 0) == 0
