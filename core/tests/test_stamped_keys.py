"""StampedKeys: the keys eviction policies put back, waiting in stamp order.

Checked against a plain dict sorted on every look (the reference): the order of keys
added one at a time and in batches (each a run, the runs merged as they grow), the
skipping of keys that left (or moved to another stamp), and the bound on the entries it
keeps."""

from __future__ import annotations

import random

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugin import StampedKeys
from lmcache_tiers.stamped_keys import DEAD_SLACK


def key(index: int) -> ObjectKey:
    return ObjectKey("m", 0, index.to_bytes(8, "big"))


def in_order(reference: dict[ObjectKey, int]) -> list[tuple[int, ObjectKey]]:
    return sorted(((stamp, k) for k, stamp in reference.items()), key=lambda entry: entry[0])


def test_keys_come_out_by_stamp_whatever_order_they_were_added_in() -> None:
    run = StampedKeys()
    stamps = list(range(50))
    random.Random(1).shuffle(stamps)
    for stamp in stamps:
        run.add(key(stamp), stamp)
    assert list(run.keys()) == [key(stamp) for stamp in range(50)]
    assert len(run) == 50 and key(3) in run and key(99) not in run


@pytest.mark.parametrize("batch", [1, 3, 256, 1000])
def test_a_batch_is_merged_among_the_keys_waiting(batch: int) -> None:
    run = StampedKeys()
    for stamp in range(0, 4 * batch, 2):  # even stamps wait one by one
        run.add(key(stamp), stamp)
    assert run.stored() == 2 * batch, "a merge neither loses nor repeats an entry"
    odd = [(key(stamp), stamp) for stamp in range(1, 4 * batch, 2)]
    random.Random(batch).shuffle(odd)
    run.add_many(odd)  # odd stamps fall between them, in no order
    assert [entry[0] for entry in run.entries()] == list(range(4 * batch))
    assert list(run.keys()) == [key(stamp) for stamp in range(4 * batch)]


def test_keys_popped_or_added_again_are_skipped_where_they_were() -> None:
    run = StampedKeys()
    run.add_many((key(stamp), stamp) for stamp in range(10))
    assert run.pop(key(0)) == 0 and run.pop(key(5)) == 5
    assert run.pop(key(5)) is None  # gone already
    run.add(key(7), 20)  # the same key at a later stamp: its old entry is dead
    run.tidy()
    expected = [1, 2, 3, 4, 6, 8, 9, 20]
    assert [entry[0] for entry in run.entries()] == expected
    assert len(run) == len(expected)


def test_tidy_drops_the_dead_front_so_a_walk_starts_at_a_live_key() -> None:
    run = StampedKeys()
    run.add_many((key(stamp), stamp) for stamp in range(100))
    for stamp in range(40):  # a walk evicted the oldest
        run.pop(key(stamp))
    run.tidy()
    assert run.stored() == 60
    assert next(run.entries()) == (40, key(40))


def test_entries_stay_bounded_by_the_live_ones_without_walks() -> None:
    # Keys put back and read again, over and over, with no walk to tidy the run: each
    # leaves a dead entry, which must not pile up (pops hold no more; adds are bounded).
    run = StampedKeys()
    rng = random.Random(7)
    stamp = 0
    for _ in range(20_000):
        k = key(rng.randrange(50))
        if rng.random() < 0.5:
            run.add(k, stamp)
            stamp += 1
            assert run.stored() <= 2 * len(run) + DEAD_SLACK
        else:
            run.pop(k)


def test_random_adds_pops_and_tidies_match_a_sorted_dict() -> None:
    rng = random.Random(3)
    run = StampedKeys()
    reference: dict[ObjectKey, int] = {}
    next_stamp = 0
    for _ in range(3_000):
        action = rng.random()
        if action < 0.4:
            k = key(rng.randrange(400))
            stamp = rng.randrange(next_stamp + 1)  # put back with an older stamp
            next_stamp += 1
            run.add(k, stamp)
            reference[k] = stamp
        elif action < 0.45:
            batch = {
                key(rng.randrange(400)): rng.randrange(next_stamp + 1) for _ in range(rng.choice([5, 600]))
            }
            run.add_many(batch.items())
            reference.update(batch)
        elif action < 0.85:
            k = key(rng.randrange(400))
            assert run.pop(k) == reference.pop(k, None)
        else:
            run.tidy()
        assert len(run) == len(reference)
        if action > 0.95:
            assert [entry[0] for entry in run.entries()] == [entry[0] for entry in in_order(reference)]
            assert set(run.keys()) == set(reference)
