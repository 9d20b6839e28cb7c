import random
import tracemalloc
from pathlib import Path

import pytest
from replay_support import write_trace

from lmcache_tiers.replay.retime import (
    RateOracle,
    bandwidth_log_likelihood,
    best_bandwidth,
    fit_rates,
    prompt_trees,
    rate_bound,
    retime,
)
from lmcache_tiers.replay.simulate import simulate_policy
from lmcache_tiers.replay.trace import KeySpace, Trace, TraceRequest, read_trace


def _line(index: int, blocks: list[int]) -> dict[str, object]:
    return {
        "timestamp": index * 10,
        "input_length": 512 * len(blocks),
        "output_length": 1,
        "hash_ids": blocks,
    }


def _clustered_trace(tmp_path: Path, spread: int, seed: int = 3) -> Trace:
    """20 prompts of 3 shared blocks, each sent 6 times within ``spread`` requests (plus
    its own tail block), among one-off requests."""
    rng = random.Random(seed)
    slots: dict[int, list[int]] = {}
    for prompt in range(20):
        start = rng.randrange(0, 1000 - spread)
        for _ in range(6):
            slots.setdefault(start + rng.randrange(spread), []).append(prompt)
    lines, fresh = [], 100_000
    for index in range(1000):
        for prompt in slots.get(index, []):
            lines.append(_line(len(lines), [prompt * 10, prompt * 10 + 1, prompt * 10 + 2, fresh]))
            fresh += 1
        lines.append(_line(len(lines), [fresh, fresh + 1]))
        fresh += 2
    return read_trace(write_trace(tmp_path / f"clustered-{spread}.jsonl", lines))


def test_prompt_trees_group_requests_by_their_first_block(synthetic_trace: Trace) -> None:
    trees = prompt_trees(synthetic_trace)
    assert sorted(index for tree in trees for index in tree) == list(range(len(synthetic_trace.requests)))
    for tree in trees:
        assert len({synthetic_trace.requests[index].hash_ids[0] for index in tree}) == 1


def test_the_likeliest_bandwidth_follows_how_tight_prompts_cluster(tmp_path: Path) -> None:
    candidates = [4, 64, 1024]
    assert best_bandwidth(_clustered_trace(tmp_path, spread=12), candidates) == 4
    assert best_bandwidth(_clustered_trace(tmp_path, spread=900), candidates) > 4


def test_a_sample_keeps_prefixes_one_offs_and_fresh_tails(synthetic_trace: Trace) -> None:
    sample = retime(synthetic_trace, 40.0, seed=5)
    again = retime(synthetic_trace, 40.0, seed=5)
    assert again.trace.requests == sample.trace.requests, "a seed must give one sample"
    assert retime(synthetic_trace, 40.0, seed=6).trace.requests != sample.trace.requests
    assert sample.trace.chain_conflicts() == 0
    assert list(sample.moments) == sorted(sample.moments)
    assert all(0.0 <= moment < len(synthetic_trace.requests) for moment in sample.moments)
    original = {block for request in synthetic_trace.requests for block in request.hash_ids}
    by_root: dict[int, list[tuple[int, ...]]] = {}
    for request in synthetic_trace.requests:
        by_root.setdefault(request.hash_ids[0], []).append(request.hash_ids)
    for request in sample.trace.requests:
        recorded = by_root[request.hash_ids[0]]
        if len(recorded) == 1:
            assert request.hash_ids == recorded[0], "a one-off request stays as it was"
            continue
        kept = [block for block in request.hash_ids if block in original]
        assert any(kept == list(blocks[: len(kept)]) for blocks in recorded), "a shared prefix is copied"
        assert request.hash_ids[: len(kept)] == tuple(kept), "fresh ids only follow the shared prefix"


def test_fresh_ids_stay_block_ids_when_the_trace_uses_the_top_of_the_range(tmp_path: Path) -> None:
    # Hash ids may be any 64-bit value: fresh tails must not count past 2**64 - 1 (which no
    # key can hold) nor reuse an id the trace has.
    top = (1 << 64) - 1
    lines = [_line(index, [top, top - 1 - index]) for index in range(6)]
    trace = read_trace(write_trace(tmp_path / "top.jsonl", lines))
    sample = retime(trace, 2.0, seed=1)
    original = {block for request in trace.requests for block in request.hash_ids}
    fresh = [
        block for request in sample.trace.requests for block in request.hash_ids if block not in original
    ]
    assert fresh and all(0 <= block <= top for block in fresh)
    assert len(set(fresh)) == len(fresh)
    run = simulate_policy(sample.trace, "rate oracle", lambda: RateOracle(sample), 4)
    assert run.total_blocks == sample.trace.block_references


def test_a_prompt_every_request_shares_is_fitted_in_bounded_memory() -> None:
    # One tree of n requests (a system prompt they all start with) once took matrices of
    # 8 n**2 bytes: gigabytes at a few tens of thousands of requests, and a MemoryError.
    requests = 3000
    trace = Trace(
        "shared-prompt", tuple(TraceRequest(float(i), 1024, 1, (0, 10 + i)) for i in range(requests))
    )
    tracemalloc.start()
    try:
        bandwidth_log_likelihood(trace, 16.0)
        fit_rates(trace, 16.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak >> 20} MiB for {requests} requests"


def test_the_bound_grows_with_capacity_and_stays_a_hit_rate(synthetic_trace: Trace) -> None:
    sample = retime(synthetic_trace, 40.0, seed=1)
    bounds = rate_bound(sample, [1, 8, 64, 10_000], synthetic_trace.block_references)
    values = [bounds[capacity] for capacity in (1, 8, 64, 10_000)]
    assert values == sorted(values) and values[0] > 0.0 and values[-1] < 1.0


def test_a_trace_of_empty_prompts_has_a_bound_of_zero(tmp_path: Path) -> None:
    trace = read_trace(write_trace(tmp_path / "t.jsonl", [_line(index, []) for index in range(3)]))
    sample = retime(trace, float(best_bandwidth(trace)), seed=1)
    assert rate_bound(sample, [1, 8], trace.block_references) == {1: 0.0, 8: 0.0}


def test_no_policy_beats_the_bound_on_average(synthetic_trace: Trace) -> None:
    # The bound holds in expectation: the mean over samples of what the policy told the
    # rates gets stays under the mean bound (it is the best policy we have for the model).
    model = fit_rates(synthetic_trace, 40.0)
    hits, bounds = [], []
    for seed in range(12):
        sample = retime(synthetic_trace, 40.0, seed, model)
        run = simulate_policy(sample.trace, "rate oracle", lambda sample=sample: RateOracle(sample), 16)
        hits.append(run.hit_blocks / synthetic_trace.block_references)
        bounds.append(rate_bound(sample, [16], synthetic_trace.block_references)[16])
    assert sum(hits) / len(hits) <= sum(bounds) / len(bounds)


def test_the_rate_oracle_evicts_blocks_nobody_needs_first(synthetic_trace: Trace) -> None:
    sample = retime(synthetic_trace, 40.0, seed=2)
    oracle = RateOracle(sample)
    oracle.start_request(0)
    shared = next(block for block in sample.model.group_of)
    space = KeySpace()
    oracle.on_keys_written([space.key(shared), space.key(10**9)])  # a block no model knows
    assert list(oracle.victims()) == [space.key(10**9), space.key(shared)]


@pytest.mark.timeout(60)
def test_a_bandwidth_far_wider_than_the_trace_still_samples(synthetic_trace: Trace) -> None:
    # moments many spans out fold back at once (past float precision they never did)
    sample = retime(synthetic_trace, 1e20, seed=1)
    span = len(synthetic_trace.requests)
    assert sample.moments and all(0.0 <= moment < span for moment in sample.moments)


def test_a_bandwidth_must_be_positive(synthetic_trace: Trace) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        retime(synthetic_trace, 0.0, seed=1)
