from itertools import islice
from pathlib import Path

import pytest
from replay_support import write_trace

from lmcache_tiers.replay.belady import belady
from lmcache_tiers.replay.foresight import (
    NEXT_USE,
    NextUseOracle,
    block_uses,
    foresight_factories,
    oracle_name,
    parse_horizons,
)
from lmcache_tiers.replay.simulate import EXACT_LRU, ExactLRU, simulate_policy
from lmcache_tiers.replay.trace import KeySpace, Trace, read_trace


def _single_block_trace(tmp_path: Path, blocks: list[int]) -> Trace:
    lines = [
        {"timestamp": index, "input_length": 512, "output_length": 1, "hash_ids": [block]}
        for index, block in enumerate(blocks)
    ]
    return read_trace(write_trace(tmp_path / "cycle.jsonl", lines))


def test_horizons_parse_and_name() -> None:
    assert parse_horizons(["0", "30", "all", " Inf "]) == [0, 30, None, None]
    assert oracle_name(None) == NEXT_USE and oracle_name(30) == "next use <= 30"
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match="horizon"):
            parse_horizons([bad])


@pytest.mark.parametrize("capacity", [4, 16, 64])
def test_no_foresight_is_exact_lru_hit_for_hit(synthetic_trace: Trace, capacity: int) -> None:
    factory = foresight_factories(synthetic_trace, [0])["next use <= 0"]
    blind = simulate_policy(synthetic_trace, "0", factory, capacity)
    lru = simulate_policy(synthetic_trace, EXACT_LRU, ExactLRU, capacity)
    assert blind.hit_blocks == lru.hit_blocks
    assert blind.l1_evictions == lru.l1_evictions


@pytest.mark.parametrize("capacity", [4, 16, 64])
def test_foresight_stays_under_belady_and_does_not_lose_to_lru(synthetic_trace: Trace, capacity: int) -> None:
    optimal = belady(synthetic_trace, capacity).hit_blocks
    lru = simulate_policy(synthetic_trace, EXACT_LRU, ExactLRU, capacity).hit_blocks
    factories = foresight_factories(synthetic_trace, [3, None])
    for name, factory in factories.items():
        hits = simulate_policy(synthetic_trace, name, factory, capacity).hit_blocks
        assert lru <= hits <= optimal, name


def test_a_cycle_lru_always_misses_is_hit_by_the_oracle(tmp_path: Path) -> None:
    # A B C A B C in a two-block cache: LRU always evicts the block needed next.
    trace = _single_block_trace(tmp_path, [1, 2, 3, 1, 2, 3])
    assert simulate_policy(trace, EXACT_LRU, ExactLRU, 2).hit_blocks == 0
    oracle = simulate_policy(trace, NEXT_USE, foresight_factories(trace, [None])[NEXT_USE], 2)
    assert oracle.hit_blocks == belady(trace, 2).hit_blocks == 2
    # One request of warning is enough here: the block needed next is kept, the other goes.
    near = simulate_policy(trace, "1", foresight_factories(trace, [1])["next use <= 1"], 2)
    assert near.hit_blocks == 2
    blind = simulate_policy(trace, "0", foresight_factories(trace, [0])["next use <= 0"], 2)
    assert blind.hit_blocks == 0


def test_a_use_entering_the_horizon_moves_a_block_behind_unknown_ones(tmp_path: Path) -> None:
    trace = _single_block_trace(tmp_path, [1, 2, 9, 9, 9, 1])
    space = KeySpace()
    first, second = space.key(1), space.key(2)
    oracle = NextUseOracle(block_uses(trace), horizon=2)
    oracle.start_request(0)
    oracle.on_keys_written([first])
    oracle.start_request(1)
    oracle.on_keys_written([second])
    assert list(oracle.victims()) == [first, second]  # neither is needed within 2 requests
    oracle.start_request(3)  # block 1 is used at request 5: within the horizon now
    assert list(oracle.victims()) == [second, first]


def test_offered_victims_stay_until_removed(synthetic_trace: Trace) -> None:
    space = KeySpace()
    oracle = NextUseOracle(block_uses(synthetic_trace), horizon=None)
    oracle.start_request(0)
    keys = space.keys(synthetic_trace.requests[0].hash_ids)
    oracle.on_keys_written(keys)
    offered = list(islice(oracle.victims(), 2))
    assert list(islice(oracle.victims(), 2)) == offered, "offering a victim must not forget it"
    oracle.on_keys_removed(offered[:1])
    remaining = list(oracle.victims())
    assert offered[0] not in remaining and set(remaining) == set(keys) - {offered[0]}
    assert len(oracle) == len(keys) - 1
