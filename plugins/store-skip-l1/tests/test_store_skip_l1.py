from lmcache_tiers.testing.policies import STORES_EVERYWHERE, StorePolicySuite, make_keys


class TestSkipL1StorePolicy(StorePolicySuite):
    component_name = "skip_l1"
    capabilities = frozenset({STORES_EVERYWHERE})

    def test_deletes_every_stored_key_from_l1(self) -> None:
        keys = make_keys(4)
        assert self.make_policy().select_l1_deletions(keys) == keys
