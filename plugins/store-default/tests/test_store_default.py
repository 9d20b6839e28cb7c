from lmcache_tiers.testing.policies import STORES_EVERYWHERE, StorePolicySuite, make_adapters, make_keys


class TestDefaultStorePolicy(StorePolicySuite):
    component_name = "default"
    capabilities = frozenset({STORES_EVERYWHERE})

    def test_never_deletes_from_l1(self) -> None:
        policy = self.make_policy()
        keys = make_keys(4)
        policy.select_store_targets(keys, make_adapters(2))
        assert policy.select_l1_deletions(keys) == []
