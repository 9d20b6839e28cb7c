import os
import random
from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_eviction_prefix_lfu import PrefixLFUConfig
from lmcache_plugin_eviction_prefix_lfu.policy import PrefixLFUEvictionPolicy

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.policies import EVICTS, EvictionPolicySuite, make_keys


class TestPrefixLFUEvictionPolicy(EvictionPolicySuite):
    component_name = "PREFIX_LFU"
    # A key with many uses may outrank one read more recently: no unconditional RECENCY.
    capabilities = frozenset({EVICTS})

    def held_aside(self) -> Callable[[Any], Iterable[ObjectKey]]:
        # A read repeating the last one is not a use: a key set aside it names stays aside.
        return lambda policy: set(policy._aside)

    def test_name_is_case_insensitive(self) -> None:
        from lmcache_tiers.plugins import load_registry
        from lmcache_tiers.registry import Kind

        assert load_registry().get(Kind.EVICTION_POLICY, "prefix_lfu").name == "PREFIX_LFU"


def test_without_credit_or_penalty_it_is_lru() -> None:
    policy = PrefixLFUEvictionPolicy(PrefixLFUConfig(frequency_credit=0.0, tail_penalty=0.0))
    first, second = make_keys(3), make_keys(2, start=10)
    policy.on_keys_written(first)
    policy.on_keys_written(second)
    policy.on_keys_read(first[:1])
    assert list(policy.victims()) == [first[2], first[1], second[1], second[0], first[0]]


def test_a_prompt_used_often_outlives_newer_prompts_used_once() -> None:
    policy = PrefixLFUEvictionPolicy()
    system_prompt = make_keys(4)
    policy.on_keys_written(system_prompt)
    for _ in range(7):
        policy.on_keys_written([])  # an empty batch changes nothing
        policy.on_keys_read(system_prompt)
        policy.on_keys_written(make_keys(1, start=500))  # breaks the duplicate-read rule
    others = make_keys(8, start=100)
    policy.on_keys_written(others)
    offered = list(policy.victims())
    assert max(offered.index(key) for key in others) < min(offered.index(key) for key in system_prompt)


def _warm() -> PrefixLFUEvictionPolicy:
    # Penalties are counted in cache turnovers: give the cache a size first.
    policy = PrefixLFUEvictionPolicy()
    policy.on_keys_written(make_keys(40, start=10_000))
    return policy


def test_the_last_chunk_of_a_write_goes_first() -> None:
    policy = _warm()
    older, newer = make_keys(4), make_keys(4, start=10)
    policy.on_keys_written(older)
    policy.on_keys_written(newer)
    offered = list(policy.victims())
    # each batch's tail starts a turnover behind: both tails go before both bodies
    assert max(offered.index(older[3]), offered.index(newer[3])) < offered.index(older[2])
    assert offered.index(older[2]) < offered.index(newer[2])


def test_a_write_right_after_a_read_is_a_tail() -> None:
    policy = _warm()
    prompt, other = make_keys(3), make_keys(3, start=50)
    policy.on_keys_written(prompt)
    policy.on_keys_written(other)
    policy.on_keys_read(prompt)
    suffix = make_keys(2, start=100)
    policy.on_keys_written(suffix)  # the request's own continuation of the prompt it read
    offered = list(policy.victims())
    assert offered.index(suffix[1]) < offered.index(suffix[0])
    # newer than everything else, yet evicted before every chunk that is not a tail
    assert offered.index(suffix[0]) < min(offered.index(key) for key in prompt + other[:2])


def test_a_repeated_read_is_counted_once() -> None:
    policy = PrefixLFUEvictionPolicy()
    keys = make_keys(3)
    policy.on_keys_written(keys)
    policy.on_keys_read(keys)
    policy.on_keys_read(keys)  # the RETRIEVE after the LOOKUP
    assert policy.uses(keys[0]) == 2
    policy.on_keys_written(make_keys(1, start=9))
    policy.on_keys_read(keys)
    assert policy.uses(keys[0]) == 3


def test_use_counts_survive_eviction() -> None:
    policy = PrefixLFUEvictionPolicy()
    keys = make_keys(2)
    policy.on_keys_written(keys)
    policy.on_keys_read(keys)
    policy.on_keys_removed(keys)
    assert len(policy) == 0 and list(policy.victims()) == []
    policy.on_keys_written(keys)
    assert policy.uses(keys[0]) == 3


def test_a_head_never_ranks_below_its_tail() -> None:
    policy = PrefixLFUEvictionPolicy()
    keys = make_keys(6)
    policy.on_keys_written(keys[3:])  # the tail was stored alone and read often
    for _ in range(5):
        policy.on_keys_read(keys[3:])
        policy.on_keys_written(make_keys(1, start=1000 + _))
    policy.on_keys_written(keys[:3])
    policy.on_keys_read(keys)  # now the whole prefix is read: heads rank with tails
    offered = list(policy.victims())
    positions = [offered.index(key) for key in keys]
    assert positions == sorted(positions, reverse=True)


def test_history_stays_bounded() -> None:
    policy = PrefixLFUEvictionPolicy(PrefixLFUConfig(history_factor=2, history_min=100))
    policy.on_keys_written(make_keys(10, start=1_000_000))
    for start in range(0, 5000, 10):
        policy.on_keys_written(make_keys(10, start=start))
        policy.on_keys_removed(list(islice(policy.victims(), 10)))
    assert len(policy) == 10
    assert len(policy._history) == 100


def _shared_trace() -> Path:
    """The shared Mooncake trace, or a skip that says where it was looked for."""
    configured = os.environ.get("LMCACHE_TIERS_REPLAY_TRACE")
    repository = Path(__file__).resolve().parents[3]
    path = (
        Path(configured)
        if configured
        else repository.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
    )
    if not path.is_file():
        reason = f"trace {path} is absent (set LMCACHE_TIERS_REPLAY_TRACE to its path)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return path


@pytest.mark.parametrize("capacity", [1000, 4000])
def test_it_beats_lru_arc_and_s3fifo_on_the_shared_trace(capacity: int) -> None:
    from lmcache_tiers.plugins import load_registry
    from lmcache_tiers.replay.simulate import EXACT_LRU, policy_factories, simulate_policy
    from lmcache_tiers.replay.trace import read_trace

    trace = read_trace(_shared_trace())
    factories = policy_factories(load_registry(), ["ARC", "S3FIFO", "PREFIX_LFU"])
    hits = {
        name: simulate_policy(trace, name, factory, capacity).hit_rate for name, factory in factories.items()
    }
    print(f"{capacity} blocks: " + ", ".join(f"{name} {rate:.4f}" for name, rate in hits.items()))
    for rival in (EXACT_LRU, "ARC", "S3FIFO"):
        assert hits["PREFIX_LFU"] > hits[rival], f"{rival} beat PREFIX_LFU at {capacity} blocks"


class _ShiftCountingList(list[int]):
    """A list that counts the elements each deletion moves (what ``del`` costs)."""

    shifted = 0

    def __delitem__(self, index: int | slice) -> None:  # type: ignore[override]
        stop = index.indices(len(self))[1] if isinstance(index, slice) else index + 1
        self.shifted += len(self) - stop
        super().__delitem__(index)


def test_evicting_many_single_chunk_levels_moves_a_linear_number_of_entries() -> None:
    # Single-chunk touches give every live key its own priority level.  Evicting from the
    # lowest level must not move the whole sorted level list each time (that made a
    # 1M-key eviction walk cost ~0.3 ms per key under the L1 lock).
    count = 4000
    policy = PrefixLFUEvictionPolicy()
    levels = _ShiftCountingList()
    policy._levels = levels
    keys = make_keys(count)
    for key in keys:
        policy.on_keys_written([key])
    for key in keys:
        policy.on_keys_read([key])
    assert len(policy._buckets) > count // 2  # the levels this test is about
    evicted = 0
    while len(policy):
        batch = list(islice(policy.victims(), 8))
        policy.on_keys_removed(batch)
        evicted += len(batch)
    assert evicted == count
    assert levels.shifted <= 4 * count


@pytest.mark.parametrize("seed", range(6))
def test_levels_match_a_sorted_model_under_random_touches_and_evictions(seed: int) -> None:
    """The level list with retired slots in front must keep giving what a plain sorted list
    of the live buckets' priorities gives: evictions from the lowest level (retiring slots),
    keys re-touched right after their level was retired (new levels below, at and above the
    retired ones), removals from the middle, and the reclaim of half the list."""
    rng = random.Random(seed)
    policy = PrefixLFUEvictionPolicy()
    pool = make_keys(64)
    held: set[int] = set()
    for _ in range(6000):
        action = rng.random()
        if action < 0.35:
            start = rng.randrange(len(pool))
            chosen = pool[start : start + rng.choice((1, 1, 2, 4))]
            policy.on_keys_written(chosen)
            held.update(pool.index(key) for key in chosen)
        elif action < 0.6 and held:
            # re-touch what was just near the bottom: its level may be a retired slot's
            victim = list(islice(policy.victims(), rng.randint(1, 3)))
            policy.on_keys_read(victim if rng.random() < 0.5 else victim[:1])
        elif action < 0.85 and held:
            batch = list(islice(policy.victims(), rng.randint(1, 4)))  # eviction
            policy.on_keys_removed(batch)
            held.difference_update(pool.index(key) for key in batch)
        elif held:
            index = rng.choice(sorted(held))  # a delete anywhere
            policy.on_keys_removed([pool[index]])
            held.discard(index)
        model = sorted(policy._buckets)
        assert list(islice(policy._levels, policy._levels_start, None)) == model
        expected = [key for priority in model for key in policy._buckets[priority]]
        assert list(policy.victims()) == expected
        assert sorted(pool.index(key) for key in expected) == sorted(held)
