"""A front end whose ``stats()`` fails for a read of ``/status`` costs no fall of the sums
over front ends under ``server``: its last readable counters stand in for it, and
``frontend_stats_held`` names it, so a total never goes back silently."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port

Factory = Callable[..., TiersServer]

#: the counters summed over front ends under /status's ``server``
SUMMED = ("stores", "store_chunks", "store_bytes", "retrieves", "retrieve_chunks", "retrieve_bytes")


def read_status(server: TiersServer) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.http_url}/status", timeout=10) as response:
        document: dict[str, Any] = json.loads(response.read())
    return document["server"]


def failures(server: TiersServer) -> dict[str, int]:
    with urllib.request.urlopen(f"{server.http_url}/status", timeout=10) as response:
        found: dict[str, int] = json.loads(response.read()).get("failures", {})
    return found


def test_status_sums_hold_while_a_front_end_cannot_be_read(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lmcache_plugin_frontend_native.frontend import NativeFrontend

    server = make_server(metrics_port=free_port())
    keys = [ObjectKey("unit", 0, bytes([index]) * 8) for index in range(3)]
    with Client(server.endpoint) as client:
        assert client.store(keys, [b"x" * 4096] * 3) == 3
        client.store(keys[:1], [b"x" * 4096])  # skipped: L1 has it
        assert client.lookup(keys) == 3
        client.release(keys)
    readable = read_status(server)
    assert readable["store_chunks"] == 3
    assert readable["store_keys_skipped"]["present"] == 1
    assert sum(readable["requests"].values()) > 0

    def broken(self: NativeFrontend) -> Any:
        raise RuntimeError("stats is broken")

    with monkeypatch.context() as patched:
        patched.setattr(NativeFrontend, "stats", broken)
        unreadable = read_status(server)
        counted = failures(server)
    for name in SUMMED:
        assert unreadable[name] == readable[name], name
    assert unreadable["requests"] == readable["requests"]
    assert unreadable["store_keys_skipped"] == readable["store_keys_skipped"]
    assert unreadable["frontend_stats_held"] == [server.frontends[0].name]
    # gauges are not held: work in flight is not shown once it may be done
    assert unreadable["clients"] == 0
    assert counted.get("frontend_report_error", 0) >= 1
    said = [record.getMessage() for record in caplog.records if "stats() failed" in record.getMessage()]
    assert said, caplog.text
    assert "its counters in the sums are the ones it last reported" in said[0], said[0]
    assert "RuntimeError: stats is broken" in said[0], said[0]

    again = read_status(server)
    assert again["frontend_stats_held"] == []
    for name in SUMMED:
        assert again[name] >= readable[name], name
