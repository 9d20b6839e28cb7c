"""bench_redis's rounds against a real ``redis-server``: every method's throughput stores
find the server as the first method's do, holding no other method's objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from bench_modules import load_bench

redis_testing = pytest.importorskip("lmcache_plugin_redis.testing")
if redis_testing.missing_reason() is not None:
    pytest.skip(redis_testing.missing_reason(), allow_module_level=True)


def test_each_method_stores_into_a_server_holding_no_other_methods_objects(monkeypatch) -> None:
    """Objects of the methods before, left stored, made the later methods' values take
    pages the server had to fault in where the first method's reused freed ones."""
    bench_redis = load_bench("bench_redis")
    timed = bench_redis.timed
    clients: list[Any] = []
    held: list[tuple[str, int]] = []

    def timed_counting_keys(step: Callable[[range], None], count: int, batch: int) -> float:
        method = step.__self__  # type: ignore[attr-defined]
        if isinstance(method, bench_redis.Direct) and not clients:
            clients.append(method.client)
        if step.__name__ == "store":
            held.append((type(method).__name__, clients[0].dbsize()))
        return timed(step, count, batch)

    monkeypatch.setattr(bench_redis, "timed", timed_counting_keys)
    bench_redis.run(objects=4, size=4096, batch=2, repeat=2)
    order = ["Direct", "Direct", "ThroughAdapter"]
    assert [name for name, _ in held] == order + order[::-1]  # reversed every other round
    assert held[0][1] == 0
    assert all(keys == 0 for _, keys in held), held
