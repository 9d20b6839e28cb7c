"""S3-FIFO's set_aside/put_back: victims L1 found locked leave the walks until their locks
end, and everything else is what S3-FIFO does with a skipped victim."""

from __future__ import annotations

from itertools import islice

import pytest
from lmcache_plugin_eviction_s3fifo import S3FIFOConfig
from lmcache_plugin_eviction_s3fifo.policy import S3FIFOEvictionPolicy

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugin import StampedKeys
from lmcache_tiers.testing.policies import (
    check_set_aside_against_reference,
    make_keys,
    put_back_past_an_unstored_key,
)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("max_frequency", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_walks_are_s3fifos_own_without_the_keys_set_aside(
    fraction: float, max_frequency: int, seed: int
) -> None:
    config = S3FIFOConfig(small_queue_fraction=fraction, max_frequency=max_frequency)
    check_set_aside_against_reference(lambda: S3FIFOEvictionPolicy(config), seed)


def locked_front(count: int, locked: int) -> tuple[S3FIFOEvictionPolicy, list[ObjectKey], list[ObjectKey]]:
    """``count`` keys written; a walk passed over its first ``locked`` victims and evicted
    the next (reported), then set those aside."""
    policy = S3FIFOEvictionPolicy()
    policy.on_keys_written(make_keys(count))
    walk = list(islice(policy.victims(), locked + 1))
    policy.on_keys_removed(walk[-1:])
    policy.set_aside(walk[:-1])
    return policy, walk[:-1], walk[-1:]


def test_victims_set_aside_are_not_walked_past_again() -> None:
    policy, passed, evicted = locked_front(40, 10)
    offered = list(policy.victims())
    assert not set(offered) & set(passed + evicted)
    assert len(offered) == 40 - 11
    assert set(passed) <= set(policy._frequency), "keys set aside are still held"


def test_victims_put_back_come_first_in_their_offer_order() -> None:
    policy, passed, _ = locked_front(40, 10)
    policy.put_back([passed[7], passed[2]])
    assert list(islice(policy.victims(), 2)) == [passed[2], passed[7]]


def test_a_victim_of_small_removed_while_set_aside_becomes_a_ghost() -> None:
    # As a skipped victim would: it was judged a victim of `small`, and it is gone.
    policy, passed, _ = locked_front(40, 3)
    policy.on_keys_removed(passed[:1])
    assert passed[0] in policy._ghosts
    policy.on_keys_written(passed[:1])
    assert passed[0] in policy._main


def test_a_victim_read_while_set_aside_goes_to_main() -> None:
    policy, passed, _ = locked_front(40, 3)
    policy.on_keys_read(passed[:1])
    assert passed[0] in policy._main and passed[0] not in policy._aside
    policy.put_back(passed)  # L1 gives it back all the same: ignored
    walk = list(policy.victims())
    assert walk[:2] == passed[1:]
    assert walk.count(passed[0]) == 1


def test_a_read_asks_whether_victims_wait_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every LOOKUP counts its keys here, under the L1 lock: whether any victim is set aside
    # or put back is asked once per batch, not once per key (each ask of a run's size is
    # a Python call, which doubled the cost of a read of keys in the queues).
    policy = S3FIFOEvictionPolicy()
    keys = make_keys(200)
    policy.on_keys_written(keys)
    asks = 0
    sized = StampedKeys.__len__

    def counted(run: StampedKeys) -> int:
        nonlocal asks
        asks += 1
        return sized(run)

    monkeypatch.setattr(StampedKeys, "__len__", counted)
    policy.on_keys_read(keys)
    policy.on_keys_written(keys)
    assert asks <= 2 * 2, f"{asks} asks of the runs' sizes for two batches of {len(keys)} keys"


def test_a_key_put_back_stays_behind_one_passed_over_unstored() -> None:
    # L1 passes over a victim not yet stored in L2 without setting it aside: it waits
    # among the victims with the stamp of its offer, so the key put back stays behind it.
    unstored, put_back, walk = put_back_past_an_unstored_key(S3FIFOEvictionPolicy())
    assert walk.index(unstored) < walk.index(put_back)
