import random
from collections import OrderedDict
from typing import Any

from lmcache_tiers.testing.policies import EVICTS, RECENCY, EvictionPolicySuite, make_keys


class TestLRUEvictionPolicy(EvictionPolicySuite):
    component_name = "LRU"
    capabilities = frozenset({EVICTS, RECENCY})

    def test_name_is_case_insensitive(self) -> None:
        from lmcache_tiers.plugins import load_registry
        from lmcache_tiers.registry import Kind

        assert load_registry().get(Kind.EVICTION_POLICY, "lru").name == "LRU"

    def test_exact_order(self) -> None:
        policy = self.make_policy()
        first, second = make_keys(3), make_keys(2, start=10)
        policy.on_keys_written(first)
        policy.on_keys_written(second)
        policy.on_keys_read(first[:1])
        assert list(policy.victims()) == [first[2], first[1], second[1], second[0], first[0]]

    def test_a_read_batch_with_a_key_not_held_moves_the_others_in_order(self) -> None:
        policy = self.make_policy()
        keys, gone = make_keys(4), make_keys(1, start=50)
        policy.on_keys_written(keys)
        # The unknown key sits mid-batch: the keys before and after it are moved as if
        # it were not there, and it is not added.
        policy.on_keys_read([keys[3], gone[0], keys[2]])
        assert list(policy.victims()) == [keys[1], keys[0], keys[2], keys[3]]
        assert len(policy) == 4

    def test_repeated_reads_leave_the_order_every_read_would_give(self) -> None:
        # The policy skips a read of the very keys it read last, when nothing changed the
        # order since; a reference moving every key of every read must agree throughout.
        rng = random.Random(16)
        keys = make_keys(12)
        policy = self.make_policy()
        reference: OrderedDict[Any, None] = OrderedDict()
        batch = keys[:4]
        for _ in range(400):
            action = rng.random()
            if action < 0.15:
                written = rng.sample(keys, rng.randint(1, 3))
                policy.on_keys_written(written)
                for key in reversed(written):
                    reference[key] = None
                    reference.move_to_end(key)
            elif action < 0.25:
                removed = rng.sample(keys, rng.randint(1, 2))
                policy.on_keys_removed(removed)
                for key in removed:
                    reference.pop(key, None)
            else:
                if action < 0.45:
                    batch = rng.sample(keys, rng.randint(1, 5))
                # the same list again, an equal copy, or the list changed in place
                read = batch if action < 0.8 else list(batch)
                policy.on_keys_read(read)
                for key in reversed(read):
                    if key in reference:
                        reference.move_to_end(key)
                if action > 0.95:
                    batch.reverse()
            assert list(policy.victims()) == list(reference)
