from collections import OrderedDict
from itertools import islice

from lmcache_plugin_eviction_s3fifo.policy import MAIN_PASSES_PER_WALK, S3FIFOEvictionPolicy

from lmcache_tiers.plugin import ObjectKey
from lmcache_tiers.testing.policies import EVICTS, EvictionPolicySuite, make_keys


class TestS3FIFOEvictionPolicy(EvictionPolicySuite):
    component_name = "S3FIFO"
    # FIFO queues: a read buys a key more passes, it does not move it behind unread keys.
    capabilities = frozenset({EVICTS})

    def test_every_spelling_resolves(self) -> None:
        from lmcache_tiers.plugins import load_registry
        from lmcache_tiers.registry import Kind

        registry = load_registry()
        for spelling in ("S3FIFO", "s3fifo", "S3-FIFO", "s3-fifo"):
            component = registry.get(Kind.EVICTION_POLICY, spelling)
            assert component.factory == registry.get(Kind.EVICTION_POLICY, "S3FIFO").factory

    def test_keys_read_since_written_survive_the_small_queue(self) -> None:
        policy = self.make_policy()
        read, unread = make_keys(2), make_keys(8, start=10)
        policy.on_keys_written(read)
        policy.on_keys_written(unread)
        policy.on_keys_read(read)
        offered = list(policy.victims())
        assert offered[: len(unread)] == list(reversed(unread))
        assert set(offered[len(unread) :]) == set(read)

    def test_a_returning_ghost_enters_the_main_queue(self) -> None:
        policy = self.make_policy()
        keys = make_keys(10)
        policy.on_keys_written(keys)
        first = next(iter(policy.victims()))
        policy.on_keys_removed([first])
        assert first in policy._ghosts
        policy.on_keys_written([first])
        assert first in policy._main and first not in policy._ghosts

    def test_skipped_victims_are_offered_first_next_time(self) -> None:
        policy = self.make_policy()
        keys = make_keys(6)
        policy.on_keys_written(keys)
        skipped = list(islice(policy.victims(), 2))  # e.g. both were read-locked
        assert list(islice(policy.victims(), 2)) == skipped
        policy.on_keys_read(skipped[:1])  # in use again: back to the main queue
        assert next(iter(policy.victims())) == skipped[1]

    def test_main_queue_spends_one_read_per_pass(self) -> None:
        policy = self.make_policy()
        hot, cold = make_keys(1), make_keys(1, start=5)
        policy.on_keys_written(hot)
        policy.on_keys_read(hot)
        policy.on_keys_read(hot)
        policy.on_keys_written(cold)
        offered = list(policy.victims())
        assert offered == [cold[0], hot[0]]

    def test_ghost_queue_stays_bounded(self) -> None:
        policy = self.make_policy()
        policy.on_keys_written(make_keys(40, start=100_000))
        for start in range(0, 4000, 40):
            policy.on_keys_written(make_keys(40, start=start))
            policy.on_keys_removed(list(islice(policy.victims(), 40)))
        assert len(policy) == 40
        assert len(policy._ghosts) <= 40


class _PopCountingQueue(OrderedDict[ObjectKey, None]):
    """An ordered dict that counts the keys taken from its front (one queue step each)."""

    popped = 0

    def popitem(self, last: bool = True) -> tuple[ObjectKey, None]:
        self.popped += 1
        return super().popitem(last=last)


def _written_with_counted_queues(
    count: int,
) -> tuple[S3FIFOEvictionPolicy, _PopCountingQueue, _PopCountingQueue, list[ObjectKey]]:
    """A policy whose queues count their pops, ``count`` keys written one by one."""
    policy = S3FIFOEvictionPolicy()
    small, main = _PopCountingQueue(), _PopCountingQueue()
    policy._small, policy._main = small, main
    keys = make_keys(count)
    for key in keys:
        policy.on_keys_written([key])
    return policy, small, main, keys


def test_the_first_eviction_after_reading_every_key_takes_a_bounded_number_of_steps() -> None:
    # Filling the cache with keys that were all read used to leave them all in `small`,
    # so the first victim cost one promotion per key (1-2 s under the L1 lock at 1M keys).
    count = 4000
    policy, small, main, keys = _written_with_counted_queues(count)
    policy.on_keys_read(keys)
    small.popped = main.popped = 0
    victim = next(iter(policy.victims()))
    assert victim in keys
    assert small.popped + main.popped <= 4
    # Every key is still offered exactly once.
    policy.on_keys_written(make_keys(10, start=count))
    offered = list(policy.victims())
    assert offered[0] == victim
    assert len(offered) == len(set(offered)) == count + 10


def test_long_random_sequences_keep_every_live_key_in_exactly_one_queue() -> None:
    # Writes, re-writes, reads, removals and walks cut short (locked victims left offered)
    # in any order: each live key sits in one of small, due, main or offered, a full walk
    # offers each once, and no live key is a ghost.
    from random import Random

    from lmcache_plugin_eviction_s3fifo import S3FIFOConfig

    for seed in range(200):
        rng = Random(seed)
        config = S3FIFOConfig(
            small_queue_fraction=rng.choice([0.1, 0.5, 0.9]), max_frequency=rng.randint(1, 4)
        )
        policy, universe, live = S3FIFOEvictionPolicy(config), make_keys(30), set()
        for _ in range(300):
            action = rng.random()
            if action < 0.35:
                batch = rng.sample(universe, rng.randint(1, 5))
                policy.on_keys_written(batch)
                live |= set(batch)
            elif action < 0.6:
                policy.on_keys_read(rng.sample(universe, rng.randint(1, 6)))
            elif action < 0.7:
                batch = rng.sample(universe, rng.randint(0, 4))
                policy.on_keys_removed(batch)
                live -= set(batch)
            else:
                wanted = rng.randint(0, len(live) + 2)
                offered = list(islice(policy.victims(), wanted))
                assert len(offered) == len(set(offered)) and set(offered) <= live
                if wanted >= len(live):
                    assert set(offered) == live
                evicted = [key for key in offered if rng.random() < 0.6]
                policy.on_keys_removed(evicted)
                live -= set(evicted)
            queues = [*policy._small, *policy._due, *policy._main, *policy._offered]
            assert len(queues) == len(set(queues)) and set(queues) == live
            assert not set(policy._ghosts) & live
        walk = list(policy.victims())
        assert len(walk) == len(set(walk)) and set(walk) == live


def test_a_main_queue_whose_keys_all_have_reads_left_gives_a_victim_in_bounded_steps() -> None:
    # CLOCK's worst case: every key of `main` has max_frequency reads left, so finding one
    # victim used to put every key back max_frequency times (3n queue steps under the L1
    # lock).  A walk now puts back at most MAIN_PASSES_PER_WALK keys, then offers the head.
    count = 3 * MAIN_PASSES_PER_WALK
    policy, small, main, keys = _written_with_counted_queues(count)
    for _ in range(1 + policy.config.max_frequency):  # the first read promotes to `main`
        policy.on_keys_read(keys)
    most = policy.config.max_frequency
    assert len(main) > 0.8 * count and all(policy._frequency[key] == most for key in main)
    small_before, small.popped, main.popped = len(small), 0, 0
    walk = iter(policy.victims())
    victim = next(walk)
    assert main.popped <= MAIN_PASSES_PER_WALK + 1
    assert small.popped <= small_before
    # The rest of the walk still offers every live key exactly once.
    rest = list(walk)
    offered = [victim, *rest]
    assert len(offered) == len(set(offered)) == count
