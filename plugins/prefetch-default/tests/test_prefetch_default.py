from lmcache_tiers.policies import AdapterInfo
from lmcache_tiers.testing.policies import LOADS_EVERY_HIT, PrefetchPolicySuite, make_adapters, make_keys


class TestDefaultPrefetchPolicy(PrefetchPolicySuite):
    component_name = "default"
    capabilities = frozenset({LOADS_EVERY_HIT})

    def test_objects_are_temporary(self) -> None:
        assert self.make_policy().retain_loaded is False

    def test_lowest_index_holder_wins(self) -> None:
        keys = make_keys(3)
        found = [[False, True, True], [True, True, False]]
        plan = self.make_policy().select_load_plan(keys, found, make_adapters(2))
        assert plan == {0: [False, True, True], 1: [True, False, False]}

    def test_lowest_index_is_by_cascade_index_not_position(self) -> None:
        keys = make_keys(1)
        adapters = [AdapterInfo(1, "mock", "1:mock", 0.0), AdapterInfo(0, "mock", "0:mock", 0.0)]
        plan = self.make_policy().select_load_plan(keys, [[True], [True]], adapters)
        assert plan == {0: [True]}
