"""bench_nixl and bench_redis run their methods in an order reversed every other round:
in one fixed order, a method always ran right after the same one and paid for (or
profited from) what it left behind -- page cache, dirty pages, warm connections, the
CPU's clock, garbage -- and every ratio compared a baseline that always went first with
a method that always went later."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bench_modules import load_bench


def test_round_order_reverses_every_other_round() -> None:
    rounds = load_bench("rounds")
    methods = ["a", "b", "c"]
    assert [rounds.round_order(methods, number) for number in range(3)] == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]
    assert methods == ["a", "b", "c"]  # the caller's list is left as it was


def went_first_and_last(orders: list[list[str]], first: str, then: str) -> set[bool]:
    """For each round, whether ``first`` ran before ``then``."""
    return {order.index(first) < order.index(then) for order in orders}


def test_bench_nixl_runs_each_baseline_before_its_method_in_one_round_and_after_in_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench_nixl = load_bench("bench_nixl")
    real_run_round = bench_nixl.run_round
    orders: list[list[str]] = []

    def run_round(method: Any, buffers: Any, drop: bool) -> None:
        if not orders or len(orders[-1]) == 8:  # the case's eight methods make a round
            orders.append([])
        orders[-1].append(method.name)
        real_run_round(method, buffers, drop)

    monkeypatch.setattr(bench_nixl, "run_round", run_round)
    args = argparse.Namespace(direct_io=False, drop_caches=False, repeat=2)
    results = bench_nixl.run_case(bench_nixl.Case(2, 64 << 10), str(tmp_path), args)
    assert len(orders) == 2 and all(len(order) == 8 for order in orders), orders
    pairs = [(result.baseline, result.method) for result in results if result.baseline]
    assert ("pwrite new files", "nixl_store_dynamic") in pairs
    assert ("pwrite reused files", "nixl_store") in pairs
    for baseline, method in pairs:
        assert went_first_and_last(orders, baseline, method) == {True, False}, (baseline, method, orders)


def test_bench_redis_runs_its_throughput_methods_in_reverse_order_every_other_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    redis_testing = pytest.importorskip("lmcache_plugin_redis.testing")
    if redis_testing.missing_reason() is not None:
        pytest.skip(redis_testing.missing_reason())
    bench_redis = load_bench("bench_redis")
    timed = bench_redis.timed
    stores: list[str] = []

    def timed_naming_stores(step: Callable[[range], None], count: int, batch: int) -> float:
        method = step.__self__  # type: ignore[attr-defined]
        if step.__name__ == "store":
            is_direct = isinstance(method, bench_redis.Direct)
            stores.append(method.names[0].split(":")[0] if is_direct else "adapter")
        return timed(step, count, batch)

    monkeypatch.setattr(bench_redis, "timed", timed_naming_stores)
    bench_redis.run(objects=4, size=4096, batch=2, repeat=2)
    assert stores == ["direct", "batch", "adapter", "adapter", "batch", "direct"]
