"""While the start-up scan runs, the keys live operations touched are remembered (the
listing may be older than what they did), but not without bound: a scan that trickles
for hours under a churn of keys forgets those no longer accounted and reads a listing
begun after that, which cannot bring back what they removed."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
from l2_backends import _SPACES, DictBackend, open_dict, wait_until

import lmcache_tiers.l2.accounting as accounting
import lmcache_tiers.l2.scan as scan
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 1000
LISTED = 4
CHURN = 200  # keys stored then deleted while the scan runs
SLACK = 8


class GatedListing(DictBackend):
    """Lists one entry per gate release, so a test can act while the scan runs."""

    gate = threading.Semaphore(0)

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        for item in super().list_keys():
            assert GatedListing.gate.acquire(timeout=30)
            yield item


@pytest.fixture
def scanning(monkeypatch: pytest.MonkeyPatch) -> Iterator[L2Adapter]:
    """An adapter over ``LISTED`` stored objects whose scan accounted the first in the
    foreground and lists one more per release of the gate."""
    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 1)
    monkeypatch.setattr(accounting, "TOUCHED_SLACK", SLACK, raising=False)
    GatedListing.gate = threading.Semaphore(1)
    namespace = uuid.uuid4().hex
    _SPACES[namespace] = {key: pattern(i, SIZE) for i, key in enumerate(make_keys(LISTED))}
    adapter = open_dict(GatedListing, namespace=namespace)
    yield adapter
    GatedListing.gate.release(1000)
    adapter.close()


def test_keys_touched_while_the_scan_runs_are_bounded_and_the_listing_read_again(
    scanning: L2Adapter,
) -> None:
    adapter = scanning
    assert adapter.stats()["scan_running"] == 1
    client = BlockingAdapterClient(adapter, timeout=30)
    listed = make_keys(LISTED)
    # Deleted while the scan runs, before the churn makes the accounting forget it.
    assert adapter.delete(listed[-1:]) == [True]
    for start in range(100, 100 + CHURN):
        churned = make_keys(1, start=start)
        assert client.store(churned, [memoryview(pattern(start, SIZE))]) == [True]
        assert adapter.delete(churned) == [True]
    touched = len(adapter.state.accounting._touched)
    assert touched <= 2 * len(adapter.state.accounting) + SLACK + 1, f"{touched} keys remembered"
    GatedListing.gate.release(1000)
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    assert adapter.stats().get("scan_relisted", 0) >= 1, "the listing was read again"
    assert adapter.used_bytes() == (LISTED - 1) * SIZE, "the key deleted during the scan stays gone"
    assert adapter.stats()["objects"] == LISTED - 1
