from lmcache_tiers.testing.policies import EVICTS, EvictionPolicySuite, make_keys


class TestARCEvictionPolicy(EvictionPolicySuite):
    component_name = "ARC"
    # A read moves a key to the frequency list, which is evicted after the recency list
    # only while the recency list is over its adaptive target: no unconditional RECENCY.
    capabilities = frozenset({EVICTS})

    def test_name_is_case_insensitive(self) -> None:
        from lmcache_tiers.plugins import load_registry
        from lmcache_tiers.registry import Kind

        assert load_registry().get(Kind.EVICTION_POLICY, "arc").name == "ARC"

    def test_keys_seen_twice_outlive_keys_seen_once(self) -> None:
        policy = self.make_policy()
        reused, scanned = make_keys(4), make_keys(20, start=100)
        policy.on_keys_written(reused)
        policy.on_keys_read(reused)
        policy.on_keys_written(scanned)  # a scan of keys nobody reads again
        offered = list(policy.victims())
        assert offered[: len(scanned)] == list(reversed(scanned))
        assert set(offered[len(scanned) :]) == set(reused)

    def test_a_ghost_hit_grows_the_recency_target(self) -> None:
        policy = self.make_policy()
        keys = make_keys(10)
        policy.on_keys_written(keys)
        policy.on_keys_read(keys[:5])  # `frequent` holds half, so `recent` may keep ghosts
        victims = list(policy.victims())[:3]
        assert set(victims) <= set(keys[5:])
        policy.on_keys_removed(victims)
        assert policy._target == 0.0
        policy.on_keys_written(victims[:1])  # evicted from `recent` too early
        assert policy._target >= 1.0
        assert victims[0] in policy._frequent

    def test_keys_removed_without_being_offered_leave_no_ghost(self) -> None:
        policy = self.make_policy()
        keys = make_keys(3)
        policy.on_keys_written(keys)
        policy.on_keys_removed(keys[:1])  # e.g. a temporary object freed after its read
        policy.on_keys_written(keys[:1])
        assert keys[0] in policy._recent and policy._target == 0.0

    def test_ghost_lists_stay_bounded(self) -> None:
        policy = self.make_policy()
        policy.on_keys_written(make_keys(50, start=100_000))
        policy.on_keys_read(make_keys(20, start=100_000))
        for start in range(0, 5000, 50):
            batch = make_keys(50, start=start)
            policy.on_keys_written(batch)
            victims = list(policy.victims())[:50]
            policy.on_keys_removed(victims)
        live = len(policy)
        assert live == 50
        assert len(policy._recent) + len(policy._recent_ghosts) <= live
        assert live + len(policy._recent_ghosts) + len(policy._frequent_ghosts) <= 2 * live

    def test_victims_follow_the_adaptive_split(self) -> None:
        policy = self.make_policy()
        frequent, recent = make_keys(3), make_keys(3, start=10)
        policy.on_keys_written(frequent)
        policy.on_keys_read(frequent)
        policy.on_keys_written(recent)
        policy._target = 6.0  # `recent` is under its target: take from `frequent` first
        offered = list(policy.victims())
        assert offered[:3] == list(reversed(frequent))
        assert offered[3:] == list(reversed(recent))

    def test_a_victim_passed_over_and_deleted_later_leaves_no_ghost(self) -> None:
        policy = self.make_policy()
        keys = make_keys(10)
        policy.on_keys_written(keys)
        policy.on_keys_read(keys[:5])  # `frequent` holds half, so `recent` may keep ghosts
        walked = list(policy.victims())
        evicted, passed_over = walked[0], walked[1]  # the second one was locked
        assert {evicted, passed_over} <= set(keys[5:])
        policy.on_keys_removed([evicted])  # the eviction's report
        assert evicted in policy._recent_ghosts
        # Later freed for another reason (a temporary prefetch after its read): it was not
        # evicted, so its return says nothing about the split.
        policy.on_keys_removed([passed_over])
        assert passed_over not in policy._recent_ghosts
        policy.on_keys_written([passed_over])
        assert passed_over in policy._recent and policy._target == 0.0
