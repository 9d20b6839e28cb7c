"""The native front end's sweep: its cadence follows the TTLs it enforces, and the
reservations it forgets uncommitted are counted per key and logged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
from native_keys import keys_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]


def sweep_interval_of(server: TiersServer) -> float:
    return float(server.frontends[0].rpc.router.sweep_interval_s)


def test_the_sweep_runs_every_quarter_of_a_short_result_ttl(make_server: Factory) -> None:
    # Results wait half the lock TTL (0.2 s): swept every 0.05 s, they are given back well
    # before L1 reaps their locks, not after.
    assert sweep_interval_of(make_server(l1_lock_ttl_s=0.4)) == 0.05


def test_the_sweep_runs_every_0_2_s_under_the_default_ttls(server: TiersServer) -> None:
    assert sweep_interval_of(server) == 0.2


def test_reservations_left_uncommitted_are_counted_per_key_when_forgotten(
    make_server: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(l1_write_ttl_s=0.5)
    keys = keys_of(3)
    with caplog.at_level(logging.WARNING), Client(server.endpoint) as writer:
        reply = writer._call(p.StoreReserve(0, "", keys, [4096] * 3), p.StoreReserveReply)
        assert all(slot.offset != p.NO_SLOT for slot in reply.slots)
        stats = stats_of(server)
        deadline = time.monotonic() + 30
        while stats.failures["store_reservation_expired"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.failures["store_reservation_expired"] == 3, "each key forgotten uncommitted, counted"
        assert server.frontends[0].handlers.sessions.gauges(time.monotonic()).reserved_stores == 0
        # A commit after the sweep forgot them finds no reservation: refused, counted as such.
        assert writer._call(p.StoreCommit(0, "", keys), p.StoreReply).done == [False] * 3
        assert stats.store_keys_refused["reservation_lost"] == 3
    assert "3 store reservations left uncommitted past the write TTL" in caplog.text
    assert stats.failures["store_reservation_expired"] == 3, "counted once, at the sweep"
