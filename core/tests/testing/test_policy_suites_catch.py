"""The policy conformance suites themselves: a suite test must fail for a policy broken the
way it checks, and pass for a sound one -- a suite test that cannot fail proves nothing."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.policies import AdapterInfo, LowestIndexPrefetchPolicy
from lmcache_tiers.testing.policies import LOADS_EVERY_HIT, PrefetchPolicySuite, probe_suite


class PlansByPosition:
    """Plans each key from the first adapter that found it, but names that adapter by its
    position in ``adapters`` instead of its cascade index: right only while every adapter
    answers (the controller passes the adapters whose lookups answered)."""

    retain_loaded = False

    def __init__(self, config: Any) -> None:
        del config

    def select_load_plan(
        self, keys: Sequence[ObjectKey], found: Sequence[Sequence[bool]], adapters: Sequence[AdapterInfo]
    ) -> dict[int, list[bool]]:
        plan: dict[int, list[bool]] = {}
        for key_position in range(len(keys)):
            for position in range(len(adapters)):
                if found[position][key_position]:
                    plan.setdefault(position, [False] * len(keys))[key_position] = True
                    break
        return plan


class SoundPolicy(LowestIndexPrefetchPolicy):
    def __init__(self, config: Any) -> None:
        del config


#: the suite's tests of the policy itself (the others check the registration)
PREFETCH_TESTS = sorted(
    name
    for name in dir(PrefetchPolicySuite)
    if name.startswith("test_")
    and "policy" in inspect.signature(getattr(PrefetchPolicySuite, name)).parameters
)


def _failures(policy: type[Any]) -> list[str]:
    suite = probe_suite(PrefetchPolicySuite, policy, frozenset({LOADS_EVERY_HIT}))
    failed = []
    for name in PREFETCH_TESTS:
        try:
            getattr(suite, name)(suite.make_policy())
        except AssertionError:
            failed.append(name)
    return failed


def test_the_prefetch_suite_fails_a_policy_naming_adapters_by_position() -> None:
    assert _failures(PlansByPosition), "no suite test failed a policy naming adapters by position"


def test_the_prefetch_suite_passes_a_sound_policy() -> None:
    assert _failures(SoundPolicy) == []
