"""The front end's sweep runs often enough for the TTLs it enforces."""

from __future__ import annotations

from typing import Any

from lmcache_tiers.server.app import TiersServer


def sweep_interval_of(server: TiersServer) -> float:
    return float(server.frontends[0].loop.router.sweep_interval_s)


def test_the_sweep_runs_every_quarter_of_half_a_short_lock_ttl(make_mp_server: Any) -> None:
    # Lookup locks are given back after half the lock TTL (0.4 s here), and a retrieve's
    # shortly before it: swept every 0.5 s, both would wait until L1 had reaped the locks.
    assert sweep_interval_of(make_mp_server(l1_lock_ttl_s=0.8)) == 0.1


def test_a_short_write_ttl_shortens_the_sweep_too(make_mp_server: Any) -> None:
    assert sweep_interval_of(make_mp_server(l1_write_ttl_s=0.4)) == 0.1


def test_the_sweep_runs_every_half_second_under_the_default_ttls(mp_server: TiersServer) -> None:
    assert sweep_interval_of(mp_server) == 0.5
