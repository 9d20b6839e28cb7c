"""L2 eviction seeding when listing the keys stored before start-up fails.

The controller feeds its policy the adapter's listing once, at start.  A listing that
fails with the circuit closed (a temporary backend error) must not leave those keys out of
the policy for good -- a store full of them would evict nothing and refuse stores above
its watermark -- nor half of them in a policy that claims to be seeded: it is retried on a
later cycle.  Events meanwhile go to the policy as they come (a queue of them would grow
with every store), and the listing that succeeds adds only the keys the policy has not
heard of.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from l2_backends import DictBackend, Fifo, keys_of, open_dict, store_blank

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter

SIZE = 1000
OBJECTS = 200


class FlakyListing(DictBackend):
    """A dict whose listing breaks off half-way, ``failures`` times, then lists in full."""

    failures = 0

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        entries = super().list_keys()
        if FlakyListing.failures > 0:
            FlakyListing.failures -= 1
            yield from entries[: len(entries) // 2]
            raise ConnectionError("listing interrupted")
        yield from entries


@pytest.fixture
def adapter() -> Iterator[BackendAdapter]:
    FlakyListing.failures = 0
    opened = open_dict(FlakyListing, capacity=OBJECTS * SIZE)
    yield opened
    opened.close()


def started_on_a_full_store(
    adapter: BackendAdapter, failing_listings: int
) -> tuple[L2EvictionController, Fifo]:
    """Keys stored before the controller listens (only its listing tells its policy about
    them), then a controller whose first ``failing_listings`` listings fail."""
    store_blank(adapter, keys_of("before-start", OBJECTS), SIZE)
    assert adapter.usage() == 1.0
    assert adapter.stats()["scan_running"] == 0  # the adapter's own start-up scan is done
    FlakyListing.failures = failing_listings
    policy = Fifo()
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    controller = L2EvictionController(AdapterSlot(0, "flaky", adapter), policy, config, EngineStats(1))
    return controller, policy


def test_a_failed_listing_is_retried_and_the_keys_stored_before_start_up_are_evicted(
    adapter: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    controller, policy = started_on_a_full_store(adapter, failing_listings=2)
    controller.seed_retry_first_s = 0.0  # retry on the very next cycle

    for failed in (1, 2):
        controller.step(set())
        assert controller.stats.failures()["l2_eviction_scan_error"] == failed, "each failed listing counts"
        assert not policy.order, "half a listing is not fed to the policy"
        assert adapter.usage() == 1.0, "nothing to evict before the listing succeeds"

    controller.step(set())

    assert adapter.usage() < 0.8, "keys stored before start-up are evicted: not full for good"
    assert controller.stats.failures()["l2_eviction_scan_error"] == 2
    logged = [r for r in caplog.records if "listing" in r.getMessage() and r.levelname == "WARNING"]
    assert len(logged) == 1, "the failed listings are logged once per burst"


def test_events_while_unseeded_reach_the_policy_and_the_listing_adds_only_new_keys(
    adapter: BackendAdapter,
) -> None:
    controller, policy = started_on_a_full_store(adapter, failing_listings=1)
    controller.seed_retry_first_s = 0.0
    controller.step(set())  # the listing fails
    assert controller.stats.failures()["l2_eviction_scan_error"] == 1
    # Room for a few more: drop some of the keys stored before start-up behind the
    # policy's back (a client's delete), then store new ones.
    gone = keys_of("before-start", 10)
    assert adapter.delete(gone) == [True] * len(gone)
    fresh = keys_of("after-start", 5)
    store_blank(adapter, fresh, SIZE)
    assert list(policy.order) == fresh, "stores while unseeded reach the policy as they come"

    controller.evict(0)  # seeds the policy, evicting nothing

    listed = [key for key in keys_of("before-start", OBJECTS) if key not in gone]
    assert list(policy.order) == fresh + listed, "listed keys join once, deleted ones not at all"


def test_a_failing_listing_is_not_retried_every_cycle(adapter: BackendAdapter) -> None:
    controller, policy = started_on_a_full_store(adapter, failing_listings=100)
    controller.seed_retry_first_s = 3600.0

    for _ in range(5):
        controller.step(set())

    assert controller.stats.failures()["l2_eviction_scan_error"] == 1, "the retry waits its interval"
    assert not policy.order
