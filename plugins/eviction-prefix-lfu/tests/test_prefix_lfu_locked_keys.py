"""PREFIX_LFU's set_aside/put_back: chunks L1 found locked leave the walks until their locks
end, keeping their priority and use count."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import pytest
from lmcache_plugin_eviction_prefix_lfu import PrefixLFUConfig
from lmcache_plugin_eviction_prefix_lfu.policy import PrefixLFUEvictionPolicy

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.policies import (
    check_set_aside_against_reference,
    make_keys,
    put_back_past_an_unstored_key,
)


@pytest.mark.parametrize("credit_and_penalty", [(0.0, 0.0), (2.0, 1.0), (8.0, 4.0)])
@pytest.mark.parametrize("seed", range(4))
def test_walks_are_prefix_lfus_own_without_the_keys_set_aside(
    credit_and_penalty: tuple[float, float], seed: int
) -> None:
    # Its walks change nothing it will offer: full walks are compared after every step.  A
    # read repeating the last one is not a use: a key set aside it names stays aside.
    credit, penalty = credit_and_penalty
    config = PrefixLFUConfig(frequency_credit=credit, tail_penalty=penalty, history_min=8)
    check_set_aside_against_reference(
        lambda: PrefixLFUEvictionPolicy(config), seed, inspect=True, held_aside=held_aside
    )


def held_aside(policy: PrefixLFUEvictionPolicy) -> set[ObjectKey]:
    return set(policy._aside)


def test_a_read_repeating_the_last_leaves_a_chunk_set_aside() -> None:
    policy = PrefixLFUEvictionPolicy()
    keys = make_keys(4)
    policy.on_keys_written(keys)
    policy.on_keys_read(keys)
    walk = list(policy.victims())
    policy.on_keys_removed([])
    policy.set_aside(walk[:1])
    policy.on_keys_read(keys)  # the RETRIEVE of the prefix the LOOKUP read: not a use
    assert list(policy.victims()) == walk[1:]


def test_a_chunk_put_back_keeps_its_priority_and_uses() -> None:
    policy = PrefixLFUEvictionPolicy()
    prompt = make_keys(6)
    policy.on_keys_written(prompt)
    walk = list(policy.victims())
    policy.on_keys_removed([])
    priorities = {key: policy._state[key][0] for key in walk}
    policy.set_aside(walk[:3])
    assert list(policy.victims()) == walk[3:]
    assert len(policy) == 6 and policy.uses(walk[0]) == 1
    policy.put_back([walk[2], walk[0]])
    assert list(policy.victims()) == [walk[0], walk[2], *walk[3:]]
    assert {key: policy._state[key][0] for key in walk} == priorities, "being locked is not a use"


def test_a_chunk_read_while_set_aside_is_ranked_as_read() -> None:
    policy = PrefixLFUEvictionPolicy(PrefixLFUConfig(frequency_credit=0.0, tail_penalty=0.0))
    keys = make_keys(4)
    for key in keys:
        policy.on_keys_written([key])
    walk = list(islice(policy.victims(), 2))
    policy.on_keys_removed([])
    policy.set_aside(walk)
    policy.on_keys_read(walk[:1])  # now the most recent chunk
    assert list(policy.victims()) == [*keys[2:], walk[0]]
    policy.put_back(walk)  # given back all the same: the read one is not duplicated
    assert list(policy.victims()) == [walk[1], *keys[2:], walk[0]]


def test_a_chunk_removed_while_set_aside_keeps_its_use_count_in_the_history() -> None:
    policy = PrefixLFUEvictionPolicy()
    keys = make_keys(3)
    policy.on_keys_written(keys)
    policy.on_keys_written(make_keys(1, start=50))
    policy.on_keys_read(keys)
    walk = list(policy.victims())
    policy.on_keys_removed([])
    locked = [key for key in walk if key in keys][:1]
    policy.set_aside(locked)
    policy.on_keys_removed(locked)
    policy.on_keys_written(locked)
    assert policy.uses(locked[0]) == 3


class LevelsChecked(PrefixLFUEvictionPolicy):
    """Checks, at each walk, that a level is listed once while its bucket or its run of
    chunks put back holds a chunk, and only then."""

    def victims(self) -> Iterator[ObjectKey]:
        levels = list(islice(self._levels, self._levels_start, None))
        assert levels == sorted(set(self._buckets) | set(self._back)), "levels out of step"
        assert all(self._buckets.values()) and all(self._back.values()), "an empty bucket or run is kept"
        return super().victims()


@pytest.mark.parametrize("seed", range(4))
def test_levels_stay_those_of_the_buckets_and_runs_put_back(seed: int) -> None:
    config = PrefixLFUConfig(history_min=8)
    check_set_aside_against_reference(
        lambda: LevelsChecked(config), seed, inspect=True, held_aside=held_aside
    )


def test_a_key_put_back_goes_ahead_of_one_passed_over_unstored() -> None:
    # L1 passes over a victim not yet stored in L2 without setting it aside: it stays in
    # its bucket, and the key put back goes ahead of it though it was behind (the departure the
    # module docstring names).
    unstored, put_back, walk = put_back_past_an_unstored_key(PrefixLFUEvictionPolicy())
    assert walk.index(put_back) < walk.index(unstored)
