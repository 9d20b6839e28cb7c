"""A front end whose ``stats()`` fails for a scrape costs its own samples, never a fall of
the counters summed over front ends: Prometheus reads a counter that falls as a reset, and
its return as that front end's whole count happening again."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port

Factory = Callable[..., TiersServer]
Series = tuple[str, tuple[tuple[str, str], ...]]


def scrape(server: TiersServer) -> tuple[dict[Series, float], set[str]]:
    """Every sample of a scrape, and the names of its counter families."""
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[Series, float] = {}
    counters: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            counters.add(family.name)
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found, counters


def fallen(before: dict[Series, float], after: dict[Series, float], counters: set[str]) -> list[str]:
    return [
        f"{name}{dict(labels)}: {value} -> {after[(name, labels)]}"
        for (name, labels), value in before.items()
        if name.removesuffix("_total") in counters
        and (name, labels) in after
        and after[(name, labels)] < value
    ]


def test_counters_summed_over_front_ends_hold_while_one_cannot_be_read(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_plugin_frontend_native.frontend import NativeFrontend

    server = make_server(metrics_port=free_port())
    keys = [ObjectKey("unit", 0, bytes([index]) * 8) for index in range(3)]
    with Client(server.endpoint) as client:
        assert client.store(keys, [b"x" * 4096] * 3) == 3
        client.store(keys[:1], [b"x" * 4096])  # skipped: L1 has it
        assert client.lookup(keys) == 3
        client.release(keys)
    readable, counters = scrape(server)
    assert readable[("lmcache_tiers_store_chunks_total", ())] == 3
    assert readable[("lmcache_tiers_store_keys_skipped_total", (("reason", "present"),))] == 1

    def broken(self: NativeFrontend) -> Any:
        raise RuntimeError("stats is broken")

    with monkeypatch.context() as patched:
        patched.setattr(NativeFrontend, "stats", broken)
        unreadable, _ = scrape(server)
    assert fallen(readable, unreadable, counters) == []
    for summed in (
        ("lmcache_tiers_stores_total", ()),
        ("lmcache_tiers_store_chunks_total", ()),
        ("lmcache_tiers_bytes_total", (("direction", "store"),)),
        ("lmcache_tiers_store_keys_skipped_total", (("reason", "present"),)),
    ):
        assert unreadable[summed] == readable[summed], summed
    # its own series are left out, not zeroed; its gauges are not held
    assert not any(name == "lmcache_tiers_requests_total" for name, _ in unreadable)
    assert unreadable[("lmcache_tiers_clients", ())] == 0
    assert unreadable[("lmcache_tiers_failures_total", (("reason", "frontend_report_error"),))] >= 1

    again, _ = scrape(server)
    assert fallen(unreadable, again, counters) == []
    assert again[("lmcache_tiers_store_chunks_total", ())] == 3
    assert math.isclose(again[("lmcache_tiers_bytes_total", (("direction", "store"),))], 3 * 4096)
