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
