"""Reads the LRU policy applies to its order only when something needs the order."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from lmcache_plugin_eviction_lru import policy as lru
from lmcache_plugin_eviction_lru.policy import LRUEvictionPolicy

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.policies import make_keys


class CountingOrder(OrderedDict[ObjectKey, None]):
    """An order that counts the keys moved to its back."""

    moves = 0

    def move_to_end(self, key: ObjectKey, last: bool = True) -> None:
        super().move_to_end(key, last)
        CountingOrder.moves += 1


def test_a_lookup_moves_no_key_until_something_needs_the_order() -> None:
    # Every LOOKUP reads its keys: the moves are made by what next needs the order (here
    # a walk), so the lookup does not pay for them.
    keys = make_keys(40)
    policy = LRUEvictionPolicy()
    policy.on_keys_written(keys)
    policy._order = CountingOrder(policy._order)
    CountingOrder.moves = 0
    for first in range(8):
        policy.on_keys_read(keys[first : first + 32])
    assert CountingOrder.moves == 0
    walk = list(policy.victims())
    assert CountingOrder.moves == 8 * 32
    # Unread first; then keys[i] for i < 7 at the head of the i-th read; then the latest
    # read, tail first.
    assert walk == [keys[39], *keys[:7], *reversed(keys[7:39])]


@pytest.mark.parametrize("pending_read_keys", [3, 20, 10_000])
def test_reads_in_a_row_leave_the_order_reading_each_at_once_gives(
    pending_read_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Runs of reads (keys repeated within a read and across reads, keys no longer held,
    # keys set aside or put back) between the calls that need the order: the policy's
    # walk is always a reference's that moves every key of every read when it comes.
    monkeypatch.setattr(lru, "PENDING_READ_KEYS", pending_read_keys)
    rng = random.Random(49 + pending_read_keys)
    keys = make_keys(30)
    policy = LRUEvictionPolicy()
    reference: OrderedDict[ObjectKey, None] = OrderedDict()
    aside: set[ObjectKey] = set()

    def touch(batch: Sequence[ObjectKey], *, write: bool) -> None:
        for key in reversed(batch):
            if write or key in reference:
                reference[key] = None
                reference.move_to_end(key)

    for _ in range(1500):
        action = rng.random()
        if action < 0.1:
            batch = rng.sample(keys, rng.randint(1, 6))
            policy.on_keys_written(batch)
            touch(batch, write=True)
            aside -= set(batch)
        elif action < 0.15:
            removed = rng.sample(keys, rng.randint(1, 3))
            policy.on_keys_removed(removed)
            for key in removed:
                reference.pop(key, None)
            aside -= set(removed)
        elif action < 0.2:
            # A walk passing over a few keys (locked), then some of those put back.
            passed = list(policy.victims())[: rng.randint(0, 3)]
            policy.set_aside(passed)
            aside |= set(passed)
            back = rng.sample(sorted(aside, key=keys.index), rng.randint(0, len(aside)))
            policy.put_back(back)
            aside -= set(back)
        elif action < 0.3:
            assert list(policy.victims()) == [key for key in reference if key not in aside]
        else:
            start = rng.randrange(len(keys))
            batch = keys[start : start + rng.randint(1, 12)]
            if rng.random() < 0.3:
                batch = batch + rng.sample(keys, 2)  # repeats, maybe keys not held
            policy.on_keys_read(batch)
            touch(batch, write=False)
            aside -= set(batch)
        assert len(policy) == len(reference)
    assert list(policy.victims()) == [key for key in reference if key not in aside]
