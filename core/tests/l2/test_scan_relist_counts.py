"""A start-up scan that reads the store's listing again (``scan_relisted``) counts the
entries it ignores once per entry, not once per listing that read it: the second listing
names the same odd entries as the first."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from l2_backends import _SPACES, DictBackend, open_dict, wait_until

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

#: stored bytes no object can have (past ``state.MAX_OBJECT_BYTES``)
IMPOSSIBLE = 1 << 60


class OddGatedListing(DictBackend):
    """Lists a non-entry and an entry of an impossible size at once, then one stored
    object per release of ``gate``, so a test can act while the scan runs."""

    gate = threading.Semaphore(0)

    def list_keys(self) -> Iterator[Any]:
        yield "not an entry"
        yield (make_keys(1, start=5000)[0], IMPOSSIBLE)
        for item in super().list_keys():
            assert OddGatedListing.gate.acquire(timeout=30)
            yield item


def test_entries_ignored_are_counted_once_when_the_listing_is_read_again(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import lmcache_tiers.l2.accounting as accounting
    import lmcache_tiers.l2.scan as scan

    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 2)  # the two odd entries, then the thread
    monkeypatch.setattr(accounting, "TOUCHED_SLACK", 8)
    OddGatedListing.gate = threading.Semaphore(0)
    namespace = uuid.uuid4().hex
    _SPACES[namespace] = {key: pattern(i, 1000) for i, key in enumerate(make_keys(3))}
    adapter = open_dict(OddGatedListing, namespace=namespace)
    adapters.append(adapter)
    try:
        assert adapter.stats()["scan_running"] == 1
        client = BlockingAdapterClient(adapter, timeout=30)
        # Keys stored and deleted while the scan runs, more than the accounting remembers:
        # the scan reads the listing again from its start, odd entries and all.
        for start in range(100, 140):
            churned = make_keys(1, start=start)
            assert client.store(churned, [memoryview(pattern(start, 1000))]) == [True]
            assert adapter.delete(churned) == [True]
    finally:
        OddGatedListing.gate.release(1000)
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    stats = adapter.stats()
    assert stats.get("scan_relisted", 0) >= 1, "the listing was not read again: the test proves nothing"
    assert adapter.used_bytes() == 3000
    assert stats["scan_invalid_entries"] == 2, (
        f"2 odd entries listed, {stats['scan_invalid_entries']} counted as ignored"
    )
    told = [
        record.getMessage() for record in caplog.records if "listed entries ignored" in record.getMessage()
    ]
    assert told == [
        "0:t: 2 listed entries ignored: 1 not (key, size) pairs, "
        "1 with an impossible size (past any object's)"
    ]
