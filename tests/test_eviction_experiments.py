"""bench/learned_eviction.py and bench/eviction_experiments.py: the studied designs keep the
eviction protocol, never beat Belady, and their ordering rules do what the study says."""

from __future__ import annotations

import random
from typing import Any

import pytest
from bench_modules import load_bench

from lmcache_tiers.replay.simulate import belady_run, infinite_run, simulate_policy
from lmcache_tiers.replay.trace import Trace, TraceRequest
from lmcache_tiers.testing.policies import make_keys

learned = load_bench("learned_eviction")
experiments = load_bench("eviction_experiments")

DESIGNS = {
    "keep times": lambda: learned.KeepTimePolicy(refresh_min=16, half_life_min=64),
    "keep times, tree classes": lambda: learned.KeepTimePolicy(tree_classes=True, refresh_min=16),
    "OPTgen": lambda: learned.OptGenPolicy(horizon=2.0),
    "OPTgen + PREFIX_LFU rank": lambda: learned.OptGenPolicy(horizon=1.0, credit=2.0, penalty=1.0),
    "hit density": lambda: learned.HitDensityPolicy(use_gap=True, use_length=True, refresh_min=16),
}


def small_trace(seed: int = 7, requests: int = 400) -> Trace:
    """Prompt trees of a few sizes, some sent again (sharing a prefix, new tails), some once."""
    rng = random.Random(seed)
    next_id = 0
    trees: list[list[int]] = []
    made: list[TraceRequest] = []
    for index in range(requests):
        tail = list(range(next_id, next_id + rng.randint(1, 6)))
        next_id += len(tail)
        if trees and rng.random() < 0.6:
            tree = rng.choice(trees)
            blocks = tuple(tree[: rng.randint(1, len(tree))] + tail)
        else:
            trees.append(tail)
            blocks = tuple(tail)
        made.append(TraceRequest(float(index), len(blocks) * 512, 1, blocks))
    return Trace("generated", tuple(made))


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_designs_offer_each_live_key_once_and_only_live_keys(name: str) -> None:
    policy: Any = DESIGNS[name]()
    keys = make_keys(12)
    policy.on_keys_written(keys[:6])
    policy.on_keys_read(keys[:3])
    policy.on_keys_read(keys[:3])  # the RETRIEVE after a LOOKUP
    policy.on_keys_written(keys[6:])
    policy.on_keys_removed([keys[4], keys[9]])
    policy.on_keys_read(make_keys(2, start=100))  # unknown keys must not appear
    offered = list(policy.victims())
    assert len(offered) == len(set(offered))
    assert set(offered) == set(keys) - {keys[4], keys[9]}


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_designs_never_beat_belady_and_stay_within_the_capacity(name: str) -> None:
    trace = small_trace()
    for capacity in (20, 80):
        run = simulate_policy(trace, name, DESIGNS[name], capacity)
        assert run.hit_blocks <= belady_run(trace, capacity).hit_blocks
        assert run.hit_blocks > 0  # the trace reuses prefixes; a cache of 80 must catch some


def test_keep_times_go_to_the_class_whose_reuses_come_soon() -> None:
    policy = learned.KeepTimePolicy()
    soon, late = (2, 5, 0), (1, 0, 0)
    policy.stats[soon] = learned.GapHistogram()
    policy.stats[late] = learned.GapHistogram()
    for index in range(100):
        policy.stats[soon].started += 1
        policy.stats[soon].close(10)
        policy.stats[late].started += 1
        if index < 5:
            policy.stats[late].close(5000)  # 5 hits for ~100 x 5,000 ticks of room
    policy.chunks = {key: None for key in make_keys(20)}  # 20 live chunks
    policy.window = 1000.0  # room: 20 chunks x 1,000 ticks
    policy._solve()
    assert policy.keep[soon] >= 10  # catches every reuse of the class (gaps of 10)
    assert policy.keep[late] == 0  # 5 hits are not worth 25 times the room there is


def test_optgen_labels_a_reuse_kept_only_while_the_cache_has_room() -> None:
    policy = learned.OptGenPolicy(window=1024.0)
    policy.capacity = 2
    cls = (2, 1, 0)
    for step in range(3):
        policy.open_by_step[step] = {cls: 5}
    policy.step = 3
    policy._train(cls, 2, 0)  # two chunks used at step 0, again now: room for both
    policy._train(cls, 1, 1)  # the cache (2 chunks) is full over steps 1-2: not kept
    assert policy.kept[cls] == 2
    assert policy.seen[cls] == 3


def test_first_in_line_offers_doomed_chunks_first_until_they_are_read() -> None:
    doomed_keys = set(make_keys(3, start=50))
    policy = experiments.FirstInLine(experiments.prefix_lfu(), lambda key: key in doomed_keys)
    kept, doomed = make_keys(3), make_keys(3, start=50)
    policy.on_keys_written(kept)
    policy.on_keys_written(doomed)
    offered = list(policy.victims())
    assert offered[:3] == list(reversed(doomed))  # tail first, as every policy offers a batch
    assert len(offered) == len(set(offered)) == 6
    policy.on_keys_read(doomed[:2])
    offered = list(policy.victims())
    assert offered[0] == doomed[2]  # the chunks read are back in the wrapped policy's order
    assert set(offered[1:]) == set(kept) | set(doomed[:2])


def test_hindsight_keep_times_with_room_for_everything_reach_the_infinite_cache() -> None:
    trace = small_trace()
    room = 2 * trace.unique_blocks()  # a block's intervals and its last wait fit in twice the span
    averaged, keep = experiments.hindsight_keep_times(trace, room)
    unbounded = infinite_run(trace).miss_ratio
    assert averaged == pytest.approx(unbounded)
    assert experiments.expiry_cache(trace, room, keep) == pytest.approx(unbounded)
    tight, tight_keep = experiments.hindsight_keep_times(trace, 10)
    assert tight > unbounded  # ten blocks cannot hold every reuse
    assert experiments.expiry_cache(trace, 10, tight_keep) > unbounded


class _KeepAll(dict[Any, int]):
    """Keep times: every class kept for ``ticks`` after each use."""

    def __init__(self, ticks: int) -> None:
        super().__init__()
        self.ticks = ticks

    def get(self, key: Any, default: Any = None) -> int:
        return self.ticks


def _trace(*requests: tuple[int, ...]) -> Trace:
    return Trace("hand", tuple(TraceRequest(float(i), len(r) * 512, 1, r) for i, r in enumerate(requests)))


def test_keep_time_occupancy_counts_what_is_held_at_each_request() -> None:
    trace = _trace((1, 2), (1,), (3,))
    # Held at the three requests' starts: nothing, then blocks 1 and 2 twice; weighted by
    # the requests' lengths (2, 1, 1 ticks).
    assert experiments.keep_time_occupancy(trace, _KeepAll(100)) == {"mean": 1.0, "p90": 2, "max": 2}
    # Kept for one tick after a use: gone by the next request, which starts two ticks later.
    assert experiments.keep_time_occupancy(trace, _KeepAll(1)) == {"mean": 0.0, "p90": 0, "max": 0}
    # Kept for two ticks: held over ticks [use, use + 2), so gone when the second request
    # starts at tick 2, while block 1, used again then, is still held at tick 3.
    assert experiments.keep_time_occupancy(trace, _KeepAll(2)) == {"mean": 0.25, "p90": 1, "max": 1}
    assert experiments.keep_time_occupancy(small_trace(), {})["max"] == 0


def test_most_used_blocks_held_from_their_first_use() -> None:
    trace = _trace((1, 2), (1, 2), (1, 3), (4,))
    assert experiments.most_used_held(trace, 1) == pytest.approx(5 / 7)  # block 1 hit twice
    assert experiments.most_used_held(trace, 2) == pytest.approx(4 / 7)  # and block 2 once
    generated = small_trace()
    everything = experiments.most_used_held(generated, generated.unique_blocks())
    assert everything == pytest.approx(infinite_run(generated).miss_ratio)
    assert experiments.most_used_held(generated, 10) > everything
