from lmcache_tiers.testing.policies import EvictionPolicySuite, make_keys


class TestNoopEvictionPolicy(EvictionPolicySuite):
    component_name = "noop"

    def test_never_offers_a_victim(self) -> None:
        policy = self.make_policy()
        policy.on_keys_written(make_keys(100))
        policy.on_keys_read(make_keys(10))
        assert list(policy.victims()) == []
