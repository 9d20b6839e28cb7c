from lmcache_tiers.testing.policies import LOADS_EVERY_HIT, PrefetchPolicySuite, make_adapters, make_keys


class TestRetainPrefetchPolicy(PrefetchPolicySuite):
    component_name = "retain"
    capabilities = frozenset({LOADS_EVERY_HIT})

    def test_objects_are_retained(self) -> None:
        assert self.make_policy().retain_loaded is True

    def test_same_plan_as_default(self) -> None:
        keys = make_keys(3)
        found = [[False, True, True], [True, True, False]]
        plan = self.make_policy().select_load_plan(keys, found, make_adapters(2))
        assert plan == {0: [False, True, True], 1: [True, False, False]}
