"""The eviction suite's checks of the optional set_aside/put_back hooks: each policy broken
in one way the checks are about fails at least one of them, and a sound one passes all."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.policies import EVICTS, EvictionPolicySuite, probe_suite


class HookedLRU:
    """A plain LRU with the hooks: keys set aside leave the order; put back, they go first,
    in the order they were set aside (they were the oldest when a walk passed them)."""

    def __init__(self, config: Any) -> None:
        del config
        self.order: OrderedDict[ObjectKey, None] = OrderedDict()
        self.aside: dict[ObjectKey, int] = {}
        self.back: dict[ObjectKey, int] = {}  # put back, by stamp
        self.next_stamp = 0

    def __len__(self) -> int:
        return len(self.order) + len(self.aside) + len(self.back)

    def forget(self, key: ObjectKey) -> bool:
        """Whether ``key`` was set aside or put back (it is neither now)."""
        return self.aside.pop(key, None) is not None or self.back.pop(key, None) is not None

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        for key in reversed(keys):
            self.forget(key)
            self.order[key] = None
            self.order.move_to_end(key)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        for key in reversed(keys):
            if key in self.order or self.forget(key):
                self.order[key] = None
                self.order.move_to_end(key)

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            self.order.pop(key, None)
            self.forget(key)

    def set_aside(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            if key in self.back:
                self.aside[key] = self.back.pop(key)
            elif key in self.order:
                del self.order[key]
                self.aside[key] = self.next_stamp
                self.next_stamp += 1

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            if key in self.aside:
                self.back[key] = self.aside.pop(key)
        self.back = dict(sorted(self.back.items(), key=lambda item: item[1]))

    def victims(self) -> Iterator[ObjectKey]:
        return chain(list(self.back), list(self.order))


class KeepsOffering(HookedLRU):
    """Takes note of nothing set aside: L1 walks past the locked keys every time."""

    def set_aside(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        pass


class NeverPutsBack(HookedLRU):
    """Keeps every key set aside: objects no eviction ever takes."""

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        pass


class PutsBackAnyKey(HookedLRU):
    """Puts back keys it does not hold aside, as if they were: live keys jump the order,
    and removed ones come back."""

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            self.order.pop(key, None)
            self.back[key] = self.aside.pop(key, -1)
        self.back = dict(sorted(self.back.items(), key=lambda item: item[1]))


class PutsBackAsNewest(HookedLRU):
    """Puts keys back at the recent end, as if being locked were a use."""

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            if self.aside.pop(key, None) is not None:
                self.order[key] = None


class RemovalKeepsAside(HookedLRU):
    """Does not forget a key removed while set aside: put back, it is offered again."""

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            self.order.pop(key, None)
            self.back.pop(key, None)


class ReadDuplicates(HookedLRU):
    """A read of a key set aside puts it in the order while it stays aside."""

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        for key in reversed(keys):
            if key in self.order or key in self.aside or self.back.pop(key, None) is not None:
                self.order[key] = None
                self.order.move_to_end(key)


class OnlySetsAside(HookedLRU):
    """Defines set_aside alone: L1 eviction ignores it, and the keys would stay aside."""

    put_back = None  # type: ignore[assignment]


#: the suite's checks of the hooks, each called with these arguments
HOOK_CHECKS: dict[str, tuple[Any, ...]] = {
    "test_keys_set_aside_are_not_offered_until_put_back": (),
    "test_put_back_ignores_keys_it_does_not_hold_aside": (),
    "test_the_same_keys_put_back_twice_are_offered_once": (),
    "test_setting_aside_a_key_twice_or_a_removed_key_is_harmless": (),
    "test_a_key_read_or_rewritten_while_set_aside_is_offered_once": (),
    "test_a_key_removed_while_set_aside_is_forgotten": (),
    "test_walks_are_the_policys_own_without_the_keys_set_aside": (0,),
    "test_l1_walks_past_each_locked_object_once": (),
}


def test_every_hook_check_of_the_suite_is_listed() -> None:
    def calls_hooked_policy(name: str) -> bool:
        return "hooked_policy" in getattr(EvictionPolicySuite, name).__code__.co_names

    suite_checks = {
        name for name in dir(EvictionPolicySuite) if name.startswith("test_") and calls_hooked_policy(name)
    }
    assert suite_checks == set(HOOK_CHECKS)


def _failures(policy: type[Any]) -> list[str]:
    suite = probe_suite(EvictionPolicySuite, policy, frozenset({EVICTS}))
    failed = []
    for name, arguments in HOOK_CHECKS.items():
        try:
            getattr(suite, name)(*arguments)
        except AssertionError:
            failed.append(name)
    return failed


def test_the_hook_checks_pass_a_sound_policy() -> None:
    assert _failures(HookedLRU) == []


@pytest.mark.parametrize(
    "broken",
    [
        KeepsOffering,
        NeverPutsBack,
        PutsBackAnyKey,
        PutsBackAsNewest,
        RemovalKeepsAside,
        ReadDuplicates,
        OnlySetsAside,
    ],
)
def test_the_hook_checks_fail_a_broken_policy(broken: type[Any]) -> None:
    assert _failures(broken), f"no hook check of the suite failed {broken.__name__}: {broken.__doc__}"
