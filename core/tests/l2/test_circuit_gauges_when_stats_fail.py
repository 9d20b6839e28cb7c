"""The circuit breaker's gauges are in an adapter's stats whatever its plugin's own
``stats()`` does: a plugin whose stats raise (or are not numbers) while its store is down
must not take ``circuit_open`` out of /status and /metrics just when it is 1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from l2_backends import AsyncDictBackend, DictBackend, open_dict

from lmcache_tiers.config import CircuitConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys


class DownStore(DictBackend):
    """A remote store that is down: every lookup raises, and so does its ``stats()``."""

    remote = True

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        raise ConnectionError("store unreachable")

    def stats(self) -> dict[str, int]:
        raise ConnectionError("store unreachable")


class AsyncDownStore(AsyncDictBackend):
    remote = True

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:  # type: ignore[override]
        raise ConnectionError("store unreachable")

    def stats(self) -> dict[str, int]:
        raise ConnectionError("store unreachable")


@pytest.mark.parametrize("backend", [DownStore, AsyncDownStore], ids=["plain", "coroutines"])
def test_circuit_gauges_show_when_the_plugins_stats_raise(
    adapters: list[BackendAdapter], backend: type[DictBackend]
) -> None:
    # Probes far apart: the circuit stays open for the whole test.
    adapter = open_dict(backend, circuit=CircuitConfig(failure_threshold=2, probe_interval_s=3600.0))
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    for _ in range(2):
        assert client.lookup_and_lock(make_keys(1)).found == [False]
    assert adapter.circuit_open
    errors_before = adapter.stats()["backend_errors"]
    stats = adapter.stats()
    assert stats.get("circuit_open") == 1, "the circuit is open, and its gauge is not in the stats"
    assert stats.get("circuit_consecutive_failures") == 2
    assert stats["backend_errors"] == errors_before + 1, "the plugin's failed stats() is counted"
    assert set(adapter.own_stat_names()) <= set(stats), "stats the status carries as core's own"
