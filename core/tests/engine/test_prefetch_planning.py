"""The prefetch planning that needs no thread, lock or adapter: which adapter each key
loads from, how far a prefix reaches once its loads are in, and repeated keys."""

from __future__ import annotations

from engine_support import keys_of

from lmcache_tiers.controllers.prefetch_requests import PrefetchRequest, contiguous_sources, unique_prefix
from lmcache_tiers.l2.interface import LookupResult

KEYS = keys_of(1, 5)


def found(*hits: bool) -> LookupResult:
    return LookupResult(list(hits), [100 if hit else 0 for hit in hits])


def request_with(sources: list[int | None], loaded: set[int]) -> PrefetchRequest:
    request = PrefetchRequest(1, list(KEYS), readers=1, l1_hits=0, result_deadline=0.0)
    request.remaining = list(KEYS)
    request.sources = sources
    request.loaded = {KEYS[position] for position in loaded}
    return request


def test_each_key_loads_from_the_lowest_planned_adapter_that_found_it() -> None:
    lookups = {0: found(True, False, True, True, False), 1: found(True, True, True, False, True)}
    plan = {0: [True, False, False, True, True], 1: [True, True, True, True, True]}
    # Key 2: adapter 0 found it but was not planned for it; key 4: adapter 0 did not find it.
    assert contiguous_sources(KEYS, plan, lookups) == [0, 1, 1, 0, 1]


def test_the_plan_ends_at_the_first_key_no_planned_adapter_found() -> None:
    lookups = {0: found(True, True, False, True, True)}
    assert contiguous_sources(KEYS, {0: [True] * 5}, lookups) == [0, 0]


def test_a_plan_shorter_than_the_keys_and_adapters_without_a_lookup_are_ignored() -> None:
    lookups = {0: found(True, True, True, True, True)}
    plan = {0: [True, True], 3: [True] * 5}  # adapter 3's lookup never reported
    assert contiguous_sources(KEYS, plan, lookups) == [0, 0]
    assert contiguous_sources(KEYS, {}, lookups) == []


def test_the_loaded_prefix_ends_at_the_first_failed_load() -> None:
    request = request_with([0, None, 1, 0], loaded={0, 3})
    # Key 1 was found READY in L1 (no load); key 2's load failed: the prefix stops there.
    assert request.loaded_prefix() == (2, [KEYS[0]])


def test_the_loaded_prefix_covers_the_whole_usable_plan_when_every_load_succeeds() -> None:
    request = request_with([1, 0, None], loaded={0, 1})
    assert request.loaded_prefix() == (3, [KEYS[0], KEYS[1]])
    assert request.found_in_l1() == [KEYS[2]]


def test_loads_are_grouped_by_source_adapter_in_prefix_order() -> None:
    request = request_with([1, 0, None, 1], loaded=set())
    assert request.loads_by_adapter() == {1: [KEYS[0], KEYS[3]], 0: [KEYS[1]]}


def test_forgetting_pins_keeps_the_other_keys_pinned() -> None:
    request = request_with([], loaded=set())
    request.pinned[0] = list(KEYS[:3])
    request.forget_pins(0, [KEYS[1]])
    request.forget_pins(2, [KEYS[0]])  # an adapter that pinned nothing
    assert request.pinned == {0: [KEYS[0], KEYS[2]], 2: []}


def test_a_repeated_key_ends_the_prefix() -> None:
    assert unique_prefix(KEYS) == KEYS
    assert unique_prefix([*KEYS[:3], KEYS[1], KEYS[4]]) == KEYS[:3]
    assert unique_prefix([]) == []
