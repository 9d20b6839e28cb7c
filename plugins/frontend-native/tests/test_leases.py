"""Zero-copy views never change silently: a broken lease is held back, or reported.

Another client's forced clear, or a reader holding its views past the lock TTL, used to
let new stores reuse the extents under a reader's views.  Now the extents are held back
while the reader may still read them, and when a reader outlasts even that, leaving the
``retrieve`` block raises StaleReadError (``retrieve_into`` retrieves again) instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from native_keys import keys_of, leases_of

from lmcache_tiers.client import Client, StaleReadError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.server.metrics import build_registry, render
from lmcache_tiers.wire import protocol as p

CHUNK = 256 << 10


def blobs(count: int, fill: int) -> list[bytes]:
    return [bytes([fill]) * CHUNK for _ in range(count)]


def outlive_lease(
    server: TiersServer, other: Client, keys: list[ObjectKey], restore: list[bytes] | None = None
) -> None:
    """What a reader holding its views for too long lives through: its locks expire, its
    objects are cleared by someone else, the grace period passes, new objects move into
    the memory; with ``restore`` the same keys are then stored again (elsewhere)."""
    l1 = server.storage.l1
    # a lock's deadline is its TTL rounded up to the lock grid
    expiry = time.monotonic() + l1.lock_ttl_s + l1.lock_grid_s + 1
    l1.expire_locks(expiry)
    assert other.clear() >= len(keys)  # unlocked now, so a plain clear removes them
    l1.expire_locks(expiry + l1.lease_grace_s + 1)
    assert other.store(keys_of(len(keys)), blobs(len(keys), 0xEE)) == len(keys)
    if restore is not None:
        assert other.store(keys, restore) == len(keys)


class InterruptedClient(Client):
    """Runs ``on_retrieve`` between a RETRIEVE's reply and the copy out of its slots, for
    the next ``interruptions`` RETRIEVEs."""

    interruptions = 0
    on_retrieve: Callable[[], None] | None = None

    def _call(
        self, request: Any, expect: Any, payloads: Sequence[Any] = (), timeout: float | None = None
    ) -> Any:
        reply = super()._call(request, expect, payloads, timeout)
        if isinstance(request, p.Retrieve) and self.interruptions and self.on_retrieve is not None:
            self.interruptions -= 1
            self.on_retrieve()
        return reply


def test_a_forced_clear_does_not_change_bytes_under_a_reader(server: TiersServer) -> None:
    keys, data = keys_of(8), blobs(8, 0x5A)
    with Client(server.endpoint) as reader, Client(server.endpoint) as other:
        assert reader.store(keys, data) == 8
        with reader.retrieve(keys) as views:
            assert other.clear(force=True) == 8
            intruders = blobs(8, 0xEE)
            assert other.store(keys_of(8), intruders) == 8  # into free memory, not the reader's
            assert [bytes(view) for view in views] == data
            assert leases_of(server)["quarantined_extents"] == 8
        # the reader's release gave the extents back at once
        held = leases_of(server)
        assert (held["quarantined_extents"], held["quarantined_forced"], held["reclaimed_released"]) == (
            0,
            8,
            8,
        )
        assert reader.lookup(keys) == 0  # the clear did remove the objects
        assert server.storage.l1.stats().read_locks == 0


def test_a_reader_that_outlives_its_lease_is_told(server: TiersServer) -> None:
    keys, data = keys_of(6), blobs(6, 0x11)
    with Client(server.endpoint) as reader, Client(server.endpoint) as other:
        reader.store(keys, data)
        with pytest.raises(StaleReadError) as stale, reader.retrieve(keys) as views:
            outlive_lease(server, other, keys)
            assert bytes(views[0]) != data[0]  # what the views show is someone else's now
        assert stale.value.keys == keys
        assert "retrieve them again" in str(stale.value)
        assert leases_of(server)["reclaimed_lease_end"] == 6


def test_a_reader_inside_the_grace_period_keeps_its_bytes(server: TiersServer) -> None:
    keys, data = keys_of(4), blobs(4, 0x33)
    l1 = server.storage.l1
    with Client(server.endpoint) as reader, Client(server.endpoint) as other:
        reader.store(keys, data)
        with reader.retrieve(keys) as views:
            l1.expire_locks(time.monotonic() + l1.lock_ttl_s + l1.lock_grid_s + 1)
            assert other.clear() == 4
            assert other.store(keys_of(4), blobs(4, 0x44)) == 4
            assert [bytes(view) for view in views] == data
        assert leases_of(server)["quarantined_expired"] == 4


@pytest.mark.parametrize(
    ("interruptions", "restored", "copied"),
    [(1, True, 5), (1, False, 0), (1 + Client.STALE_RETRIES, True, None)],
    ids=["retried and copied", "gone when retried", "stale every time"],
)
def test_retrieve_into_checks_every_copy(
    server: TiersServer, interruptions: int, restored: bool, copied: int | None
) -> None:
    keys, data = keys_of(5), blobs(5, 0x66)
    out = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
    with InterruptedClient(server.endpoint) as reader, Client(server.endpoint) as other:
        reader.store(keys, data)
        reader.on_retrieve = lambda: outlive_lease(server, other, keys, data if restored else None)
        reader.interruptions = interruptions
        if copied is None:
            with pytest.raises(StaleReadError) as stale:
                reader.retrieve_into(keys, out)
            assert stale.value.keys == keys
        else:
            # the copy that read the intruders' bytes is noticed; what is returned is exact
            assert reader.retrieve_into(keys, out) == copied
            assert [bytes(buffer) for buffer in out[:copied]] == data[:copied]
        retrieves = server.frontends[0].stats().requests["Retrieve"]
        assert retrieves == min(interruptions + 1, 1 + Client.STALE_RETRIES)


def test_lease_counters_reach_metrics(server: TiersServer) -> None:
    keys = keys_of(2)
    with Client(server.endpoint) as reader, Client(server.endpoint) as other:
        reader.store(keys, blobs(2, 1))
        with reader.retrieve(keys):
            other.clear(force=True)
            text = render(build_registry(server.frontend_stats, server.storage_status)).decode()
            assert "lmcache_tiers_l1_quarantined_extents 2.0" in text
            assert 'lmcache_tiers_l1_quarantined_total{reason="forced"} 2.0' in text
    text = render(build_registry(server.frontend_stats, server.storage_status)).decode()
    assert 'lmcache_tiers_l1_quarantine_reclaimed_total{how="released"} 2.0' in text
    assert f"lmcache_tiers_l1_quarantine_reclaimed_bytes_total {2 * CHUNK}.0" in text
