"""ARC's set_aside/put_back: keys L1 found locked leave the walks until their locks end,
and ARC's lists, target and ghosts stay what they would be without the hooks."""

from __future__ import annotations

from itertools import islice

import pytest
from lmcache_plugin_eviction_arc.policy import ARCEvictionPolicy

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.policies import (
    check_set_aside_against_reference,
    make_keys,
    put_back_past_an_unstored_key,
)


@pytest.mark.parametrize("seed", range(12))
def test_walks_are_arcs_own_without_the_keys_set_aside(seed: int) -> None:
    # ARC's walks change nothing it will offer: full walks are compared after every step.
    check_set_aside_against_reference(ARCEvictionPolicy, seed, inspect=True)


def split_policy() -> tuple[ARCEvictionPolicy, list[ObjectKey], list[ObjectKey]]:
    """Ten keys in T2 (read) and ten in T1, the target letting T2 go first."""
    policy = ARCEvictionPolicy()
    frequent, recent = make_keys(10), make_keys(10, start=100)
    policy.on_keys_written(frequent)
    policy.on_keys_read(frequent)
    policy.on_keys_written(recent)
    policy._target = 12.0  # T1 (10) plus 3 victims of T2 passes it: T2 gives 3 first
    return policy, frequent, recent


def test_keys_set_aside_still_count_in_the_split_of_a_walk() -> None:
    policy, frequent, recent = split_policy()
    walk = list(policy.victims())
    assert walk[:3] == list(reversed(frequent))[:3]
    policy.on_keys_removed([])
    policy.set_aside(walk[:2])  # the first two were locked
    # Still three positions of T2 before T1: the two set aside and one more.
    assert list(islice(policy.victims(), 2)) == [walk[2], *reversed(recent[-1:])]
    assert len(policy) == 20


def test_a_key_put_back_returns_to_the_front_of_its_own_list() -> None:
    policy = split_policy()[0]
    policy._target = 0.0  # T1 first
    walk = list(policy.victims())
    policy.on_keys_removed([])
    policy.set_aside(walk[:3])  # three of T1, locked
    policy.put_back([walk[2], walk[0]])
    assert {walk[0], walk[2]} <= set(policy._back_recent.live), "being locked is not a use"
    assert list(islice(policy.victims(), 3)) == [walk[0], walk[2], walk[3]]


def test_a_key_read_while_set_aside_goes_to_t2_and_removed_leaves_no_ghost() -> None:
    policy = split_policy()[0]
    policy._target = 0.0
    walk = list(policy.victims())
    policy.on_keys_removed([])
    policy.set_aside(walk[:2])
    policy.on_keys_read(walk[:1])
    assert next(reversed(policy._frequent)) == walk[0]
    policy.on_keys_removed(walk[1:2])  # deleted by force: no walk evicted it
    assert walk[1] not in policy._recent_ghosts
    policy.put_back(walk[:2])
    offered = list(policy.victims())
    assert offered.count(walk[0]) == 1 and walk[1] not in offered


def test_a_key_put_back_goes_ahead_of_one_passed_over_unstored() -> None:
    # L1 passes over a victim not yet stored in L2 without setting it aside: it stays in
    # its list, and the key put back goes ahead of it though it was behind (the departure the
    # module docstring names).
    unstored, put_back, walk = put_back_past_an_unstored_key(ARCEvictionPolicy())
    assert walk.index(put_back) < walk.index(unstored)
