import random
from itertools import combinations
from pathlib import Path

import pytest
from replay_support import synthetic_lines, write_trace

from lmcache_tiers.plugins import load_registry
from lmcache_tiers.replay.belady import belady, infinite
from lmcache_tiers.replay.simulate import policy_factories, simulate_policy
from lmcache_tiers.replay.trace import Trace, TraceRequest, read_trace


def _trace(requests: list[list[int]]) -> Trace:
    return Trace(
        "test", tuple(TraceRequest(float(i), 512 * len(b), 1, tuple(b)) for i, b in enumerate(requests))
    )


def optimum(trace: Trace, capacity: int) -> int:
    """Exhaustive search: after each request keep any subset (of at most ``capacity``
    blocks) of what was cached and what the request brought; maximise prefix hits."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for request in trace.requests:
        following: dict[frozenset[int], int] = {}
        for state, value in best.items():
            hits = 0
            for block in request.hash_ids:
                if block not in state:
                    break
                hits += 1
            pool = sorted(state | set(request.hash_ids))
            for size in range(min(capacity, len(pool)) + 1):
                for kept in combinations(pool, size):
                    key = frozenset(kept)
                    if following.get(key, -1) < value + hits:
                        following[key] = value + hits
        best = following
    return max(best.values())


def _random_forest_trace(rng: random.Random, requests: int, blocks: int) -> Trace:
    parent = {block: rng.choice([None, *range(block)]) for block in range(blocks)}

    def path(block: int) -> list[int]:
        chain: list[int] = []
        node: int | None = block
        while node is not None:
            chain.append(node)
            node = parent[node]
        return chain[::-1]

    return _trace([path(rng.randrange(blocks)) for _ in range(requests)])


@pytest.mark.parametrize("seed", range(25))
def test_belady_is_the_optimum_on_prefix_forests(seed: int) -> None:
    rng = random.Random(seed)
    trace = _random_forest_trace(rng, requests=rng.randint(4, 9), blocks=rng.randint(3, 8))
    for capacity in (1, 2, 3):
        result = belady(trace, capacity)
        assert result.held_blocks == result.hit_blocks, "Belady held a block without its prefix"
        assert result.hit_blocks == optimum(trace, capacity)


@pytest.mark.parametrize("seed", range(10))
def test_belady_bounds_the_optimum_on_arbitrary_traces(seed: int) -> None:
    rng = random.Random(1000 + seed)
    requests = [rng.sample(range(7), rng.randint(1, 4)) for _ in range(rng.randint(4, 8))]
    trace = _trace(requests)
    for capacity in (1, 2, 3):
        result = belady(trace, capacity)
        assert result.hit_blocks <= optimum(trace, capacity) <= result.held_blocks


def test_infinite_counts_prefix_blocks_seen_before() -> None:
    trace = _trace([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3, 7]])
    result = infinite(trace)
    assert result.hits_per_request == (0, 2, 1, 0, 3)
    assert belady(trace, 100).hit_blocks == result.hit_blocks


def test_belady_never_loses_to_a_policy(tmp_path: Path) -> None:
    trace = read_trace(write_trace(tmp_path / "t.jsonl", synthetic_lines(11, requests=400)))
    factories = policy_factories(load_registry())
    for capacity in (4, 16, 48, 128):
        optimal = belady(trace, capacity).hit_blocks
        for name, factory in factories.items():
            run = simulate_policy(trace, name, factory, capacity)
            assert run.hit_blocks <= optimal, f"{name} beat Belady at {capacity} blocks"


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        belady(_trace([[1]]), 0)
