"""Conformance suites for store, prefetch and eviction policies.

A policy plugin's tests subclass the suite of its kind, set ``component_name`` and, where
the policy does something optional, declare it in ``capabilities``::

    class TestLRU(EvictionPolicySuite):
        component_name = "LRU"
        capabilities = frozenset({EVICTS, RECENCY})

The suites build the policy through the installed registry (``create(config())``), so
they also prove the plugin's manifest and factory agree.  Override ``make_config`` to test
a non-default configuration.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, ClassVar, TypeVar, cast

import msgspec
import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.policies import AdapterInfo, EvictionPolicy, PrefetchPolicy, StorePolicy
from lmcache_tiers.registry import ComponentRegistry, EmptyConfig, Kind
from lmcache_tiers.testing.base import ComponentSuite, capability, requires
from lmcache_tiers.testing.l2_support import make_keys as make_keys

#: eviction: ``victims()`` offers every live key (a policy that never evicts lacks it)
EVICTS = capability("evicts")
#: eviction: a read moves a key behind keys that were not read since
RECENCY = capability("recency")
#: prefetch: every key some adapter found is planned from one of them
LOADS_EVERY_HIT = capability("loads_every_hit")
#: store: every key goes to every adapter
STORES_EVERYWHERE = capability("stores_everywhere")


def assert_offered_once(offered: Sequence[ObjectKey], expected: Iterable[ObjectKey], what: str) -> None:
    """``offered`` (a walk of ``victims()``) holds each expected key exactly once."""
    wanted = set(expected)
    assert len(offered) == len(set(offered)), f"{what}: a key is offered twice"
    assert set(offered) == wanted, f"{what}: offered {len(offered)} keys, expected {len(wanted)}"


def put_back_past_an_unstored_key(policy: Any) -> tuple[ObjectKey, ObjectKey, list[ObjectKey]]:
    """A walk as L1 makes it over six keys written in one batch: the 1st victim evicted,
    the 2nd passed over without being set aside (not yet stored in L2), the 3rd locked and
    set aside, the 4th evicted; then the 3rd put back.  Returns the 2nd, the 3rd and the
    next full walk (ended by an empty removal report), for a policy's tests to say which
    of the two it offers first."""
    policy.on_keys_written(make_keys(6))
    walk = list(islice(policy.victims(), 4))
    policy.on_keys_removed([walk[0], walk[3]])
    policy.set_aside(walk[2:3])
    policy.put_back(walk[2:3])
    after = list(policy.victims())
    policy.on_keys_removed([])
    return walk[1], walk[2], after


def check_set_aside_against_reference(
    make_policy: Callable[[], Any],
    seed: int,
    *,
    steps: int = 2000,
    inspect: bool = False,
    held_aside: Callable[[Any], Iterable[ObjectKey]] | None = None,
) -> None:
    """Drive a policy with the ``set_aside``/``put_back`` hooks and a reference built the
    same way, never given them, with the same random writes, reads, removals, locks and
    eviction walks; every walk of the policy must be the reference's walk with the keys set
    aside left out.

    Walks are made as L1 makes them: the keys whose locks ended (or that left L1) put back
    first, in any order and some twice; victims taken until ``wanted`` unlocked ones are
    evicted (the walk stopped right after the last, as L1 stops); the locked ones passed
    over set aside after the removal report (no victim is passed over as not yet stored
    in L2, which L1 leaves in the policy's order: see ``put_back_past_an_unstored_key``).
    Both walks advance in step, so a policy whose walks change its state is compared too.
    ``inspect``: also compare full walks after every step (each ended by an empty removal
    report), for policies whose walks do not change what they will offer.  A read or write
    is taken to bring the keys set aside it names back into the order; ``held_aside``,
    given the policy, names the keys it still holds aside instead, for a policy that
    ignores some reads (prefix-LFU ignores a read repeating the last): those left aside
    must be among the keys held aside before.
    """
    rng = random.Random(seed)
    policy, reference = make_policy(), make_policy()
    keys = make_keys(24)
    locked: set[ObjectKey] = set()
    aside: set[ObjectKey] = set()  # held aside by the policy
    due_back: set[ObjectKey] = set()  # L1's record: given back once unlocked

    def both(event: str, batch: Sequence[ObjectKey]) -> None:
        getattr(policy, event)(batch)
        getattr(reference, event)(batch)

    def after_use(batch: Sequence[ObjectKey]) -> None:
        if held_aside is None:
            aside.difference_update(batch)
            return
        still = set(held_aside(policy))
        assert still <= aside, "a read or write set a key aside"
        aside.intersection_update(still)

    def compare_full_walks() -> None:
        expected = [key for key in reference.victims() if key not in aside]
        assert list(policy.victims()) == expected, (
            "the walk is not the reference's without the keys set aside"
        )
        both("on_keys_removed", [])

    for _ in range(steps):
        action = rng.random()
        if action < 0.25:
            batch = rng.sample(keys, rng.randint(1, 4))
            both("on_keys_written", batch)
            after_use(batch)  # a rewrite takes a key set aside back into the order
        elif action < 0.45:
            batch = rng.sample(keys, rng.randint(1, 4))
            both("on_keys_read", batch)
            after_use(batch)
        elif action < 0.55:
            batch = rng.sample(keys, rng.randint(1, 2))
            both("on_keys_removed", batch)
            aside -= set(batch)
        elif action < 0.7:
            locked ^= set(rng.sample(keys, rng.randint(1, 3)))  # some locked, some released
        else:
            released = [key for key in due_back if key not in locked]
            released += rng.sample(released, len(released) // 3)  # given twice
            rng.shuffle(released)
            policy.put_back(released)
            due_back -= set(released)
            aside -= set(released)
            _walk_in_step(policy, reference, aside, locked, due_back, rng.randint(1, 3))
        if inspect:
            compare_full_walks()
    if inspect:
        compare_full_walks()
    if hasattr(policy, "__len__"):
        assert len(policy) == len(reference), "keys set aside are not counted as held"


def _walk_in_step(
    policy: Any,
    reference: Any,
    aside: set[ObjectKey],
    locked: set[ObjectKey],
    due_back: set[ObjectKey],
    wanted: int,
) -> None:
    """One eviction walk of ``policy`` next to the reference's without ``aside`` (see
    ``check_set_aside_against_reference``); sets aside the locked keys it passed over."""
    walk = policy.victims()
    expected = (key for key in reference.victims() if key not in aside)
    passed: list[ObjectKey] = []
    evicted: list[ObjectKey] = []
    for key in walk:
        assert key == next(expected, None), "the walk is not the reference's without the keys set aside"
        if key in locked:
            passed.append(key)
            continue
        evicted.append(key)
        if len(evicted) == wanted:
            break
    else:
        assert next(expected, None) is None, "the walk ended before the reference's"
    close = getattr(walk, "close", None)
    if close is not None:
        close()  # as L1 closes a walk it stopped
    policy.on_keys_removed(evicted)
    reference.on_keys_removed(evicted)
    policy.set_aside(passed)
    aside |= set(passed)
    due_back |= set(passed)


class _CountingWalks:
    """An eviction policy, its hooks and all, counting the keys its walks offer."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.offered = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def victims(self) -> Iterator[ObjectKey]:
        for key in self.policy.victims():
            self.offered += 1
            yield key


def make_adapters(count: int) -> list[AdapterInfo]:
    return [AdapterInfo(index, "mock", f"{index}:mock", 0.0) for index in range(count)]


class _PolicySuite(ComponentSuite):
    def make_config(self) -> msgspec.Struct:
        """The config the policy is built with; the Struct's defaults unless overridden."""
        config_type: Any = self.registered_component().config
        built: msgspec.Struct = config_type()
        return built

    def make_policy(self) -> Any:
        return self.registered_component().create(self.make_config())


class StorePolicySuite(_PolicySuite):
    """What every store policy must do."""

    kind: ClassVar[Kind] = Kind.STORE_POLICY

    @pytest.fixture
    def policy(self) -> StorePolicy:
        built = self.make_policy()
        assert isinstance(built, StorePolicy)
        return built

    def test_targets_are_known_adapters_and_given_keys(self, policy: StorePolicy) -> None:
        keys = make_keys(6)
        adapters = make_adapters(3)
        targets = policy.select_store_targets(keys, adapters)
        assert set(targets) <= {a.index for a in adapters}
        for chosen in targets.values():
            assert set(chosen) <= set(keys)
            assert len(chosen) == len(set(chosen)), "a key must not be stored twice in one adapter"

    def test_no_adapters_means_no_targets(self, policy: StorePolicy) -> None:
        targets = policy.select_store_targets(make_keys(3), [])
        assert not any(targets.values())

    def test_no_keys_means_nothing_to_store(self, policy: StorePolicy) -> None:
        targets = policy.select_store_targets([], make_adapters(2))
        assert not any(targets.values())

    def test_deletions_are_a_subset_of_stored_keys(self, policy: StorePolicy) -> None:
        keys = make_keys(5)
        assert set(policy.select_l1_deletions(keys)) <= set(keys)
        assert list(policy.select_l1_deletions([])) == []

    def test_is_deterministic(self, policy: StorePolicy) -> None:
        keys = make_keys(4)
        adapters = make_adapters(2)
        assert policy.select_store_targets(keys, adapters) == policy.select_store_targets(keys, adapters)

    @requires(STORES_EVERYWHERE)
    def test_every_key_goes_to_every_adapter_in_order(self, policy: StorePolicy) -> None:
        keys = make_keys(4)
        adapters = make_adapters(3)
        assert policy.select_store_targets(keys, adapters) == {a.index: keys for a in adapters}


class PrefetchPolicySuite(_PolicySuite):
    """What every prefetch policy must do."""

    kind: ClassVar[Kind] = Kind.PREFETCH_POLICY

    @pytest.fixture
    def policy(self) -> PrefetchPolicy:
        built = self.make_policy()
        assert isinstance(built, PrefetchPolicy)
        return built

    @staticmethod
    def check_plan(
        plan: dict[int, list[bool]],
        found: Sequence[Sequence[bool]],
        adapters: Sequence[AdapterInfo],
        n_keys: int,
    ) -> None:
        positions = {a.index: p for p, a in enumerate(adapters)}
        assert set(plan) <= set(positions), "plan names an adapter that does not exist"
        for index, bitmap in plan.items():
            assert len(bitmap) == n_keys
            for key_position, wanted in enumerate(bitmap):
                assert not wanted or found[positions[index]][key_position], (
                    f"key {key_position} planned from adapter {index}, which does not hold it"
                )
        for key_position in range(n_keys):
            sources = [index for index, bitmap in plan.items() if bitmap[key_position]]
            assert len(sources) <= 1, f"key {key_position} planned from several adapters: {sources}"

    def test_retain_loaded_is_a_bool(self, policy: PrefetchPolicy) -> None:
        assert isinstance(policy.retain_loaded, bool)

    def test_plan_only_loads_what_was_found(self, policy: PrefetchPolicy) -> None:
        keys = make_keys(5)
        adapters = make_adapters(3)
        found = [
            [True, False, True, False, False],
            [True, True, False, False, True],
            [False, True, True, False, True],
        ]
        self.check_plan(policy.select_load_plan(keys, found, adapters), found, adapters, len(keys))

    def test_plan_names_adapters_by_index_not_position(self, policy: PrefetchPolicy) -> None:
        # The controller passes only the adapters whose lookups answered: with adapters 0
        # and 2 down, ``found[0]`` is adapter 1's and ``found[1]`` adapter 3's.
        keys = make_keys(4)
        adapters = [AdapterInfo(index, "mock", f"{index}:mock", 0.0) for index in (1, 3)]
        found = [[True, False, False, True], [False, True, False, True]]
        plan = policy.select_load_plan(keys, found, adapters)
        self.check_plan(plan, found, adapters, len(keys))
        if LOADS_EVERY_HIT in self.capabilities:
            planned = [any(bitmap[k] for bitmap in plan.values()) for k in range(len(keys))]
            assert planned == [True, True, False, True]

    def test_nothing_found_plans_nothing(self, policy: PrefetchPolicy) -> None:
        keys = make_keys(3)
        adapters = make_adapters(2)
        plan = policy.select_load_plan(keys, [[False] * 3, [False] * 3], adapters)
        assert not any(any(bitmap) for bitmap in plan.values())

    def test_no_adapters_plans_nothing(self, policy: PrefetchPolicy) -> None:
        assert not any(any(b) for b in policy.select_load_plan(make_keys(2), [], []).values())

    @requires(LOADS_EVERY_HIT)
    def test_every_hit_is_planned(self, policy: PrefetchPolicy) -> None:
        keys = make_keys(4)
        adapters = make_adapters(2)
        found = [[True, False, False, True], [False, True, False, True]]
        plan = policy.select_load_plan(keys, found, adapters)
        self.check_plan(plan, found, adapters, len(keys))
        planned = [any(bitmap[k] for bitmap in plan.values()) for k in range(len(keys))]
        assert planned == [True, True, False, True]


class EvictionPolicySuite(_PolicySuite):
    """What every eviction policy must do (for L1 and for L2 adapters alike)."""

    kind: ClassVar[Kind] = Kind.EVICTION_POLICY

    @pytest.fixture
    def policy(self) -> EvictionPolicy:
        built = self.make_policy()
        assert isinstance(built, EvictionPolicy)
        return built

    def evicts(self) -> bool:
        """Whether the policy declares ``EVICTS``: then the checks that only bound what a
        walk offers also require every live key in it (a policy ignoring events fails)."""
        return EVICTS in self.capabilities

    def test_empty_policy_offers_no_victims(self, policy: EvictionPolicy) -> None:
        assert list(policy.victims()) == []

    def test_victims_are_only_live_keys(self, policy: EvictionPolicy) -> None:
        keys = make_keys(8)
        policy.on_keys_written(keys)
        policy.on_keys_read(keys[:3])
        policy.on_keys_removed(keys[2:5])
        offered = list(policy.victims())
        assert set(offered) <= set(keys) - set(keys[2:5])
        assert len(offered) == len(set(offered)), "a key is offered twice"
        if self.evicts():
            assert_offered_once(offered, set(keys) - set(keys[2:5]), "live keys")

    def test_unknown_keys_are_ignored(self, policy: EvictionPolicy) -> None:
        # Checked before anything removes the read key: a removal would hide a revival.
        policy.on_keys_removed(make_keys(1, start=100))
        policy.on_keys_read(make_keys(1, start=200))
        assert list(policy.victims()) == [], "a key that was never written is offered"
        policy.on_keys_removed([])
        keys = make_keys(3)
        policy.on_keys_written(keys)
        policy.on_keys_removed(make_keys(2, start=100))
        policy.on_keys_read(make_keys(1, start=200))
        offered = list(policy.victims())
        assert set(offered) <= set(keys), "a key that was never written is offered"
        if self.evicts():
            assert_offered_once(offered, keys, "removing unknown keys dropped live ones")

    def test_a_read_after_removal_does_not_revive_the_key(self, policy: EvictionPolicy) -> None:
        # A reader that raced the removal reports its read afterwards.
        keys = make_keys(4)
        policy.on_keys_written(keys)
        policy.on_keys_removed(keys[1:2])
        policy.on_keys_read(keys)
        policy.on_keys_read(keys[1:2])
        offered = list(policy.victims())
        assert keys[1] not in offered, "a removed key came back with a read"
        if self.evicts():
            assert_offered_once(offered, keys[:1] + keys[2:], "a read lost a live key")

    def test_an_empty_removal_report_after_a_walk_changes_nothing(self, policy: EvictionPolicy) -> None:
        # Core ends a walk that removed nothing (every victim locked or pinned) this way.
        keys = make_keys(6)
        policy.on_keys_written(keys)
        before = list(policy.victims())
        if self.evicts():
            assert_offered_once(before, keys, "a walk")
        policy.on_keys_removed([])
        assert list(policy.victims()) == before

    def test_stopping_early_leaves_the_policy_usable(self, policy: EvictionPolicy) -> None:
        keys = make_keys(6)
        policy.on_keys_written(keys)
        first = list(islice(policy.victims(), 2))
        policy.on_keys_removed(first)
        rest = list(policy.victims())
        assert not set(first) & set(rest)
        if self.evicts():
            # the keys the abandoned walk did not reach are still there to evict
            assert len(first) == 2
            assert_offered_once(rest, set(keys) - set(first), "an abandoned walk lost keys")

    @requires(EVICTS)
    def test_keys_a_walk_passed_over_stay_offered(self, policy: EvictionPolicy) -> None:
        # The caller skips locked victims and reports only what it removed.
        keys = make_keys(6)
        policy.on_keys_written(keys)
        walked = list(policy.victims())
        policy.on_keys_removed(walked[1:2])
        offered = list(policy.victims())
        assert_offered_once(offered, set(keys) - {walked[1]}, "a passed-over key is lost")
        policy.on_keys_removed([])
        policy.on_keys_removed(offered[-1:])  # removed for another reason, after the walk
        assert_offered_once(list(policy.victims()), set(keys) - {walked[1], offered[-1]}, "after a walk")

    @requires(EVICTS)
    def test_a_key_repeated_in_one_event_is_offered_once(self, policy: EvictionPolicy) -> None:
        a, b, c = make_keys(3)
        policy.on_keys_written([a, b, a])
        policy.on_keys_written([c, c])
        policy.on_keys_read([b, b, c])
        assert_offered_once(list(policy.victims()), {a, b, c}, "repeated keys")
        policy.on_keys_removed([a, a])
        assert_offered_once(list(policy.victims()), {b, c}, "a key removed twice in one report")

    @requires(EVICTS)
    def test_offers_every_live_key_once(self, policy: EvictionPolicy) -> None:
        keys = make_keys(10)
        policy.on_keys_written(keys[:5])
        policy.on_keys_written(keys[5:])
        policy.on_keys_written(keys[:2])  # rewriting must not duplicate
        policy.on_keys_removed([keys[7]])
        offered = list(policy.victims())
        assert len(offered) == len(set(offered)) == 9
        assert set(offered) == set(keys) - {keys[7]}

    @requires(EVICTS)
    def test_tail_of_a_batch_goes_before_its_head(self, policy: EvictionPolicy) -> None:
        keys = make_keys(5)
        policy.on_keys_written(keys)
        offered = list(policy.victims())
        assert offered.index(keys[4]) < offered.index(keys[0])
        assert [offered.index(k) for k in reversed(keys)] == sorted(offered.index(k) for k in keys)

    @requires(EVICTS)
    def test_tail_of_a_read_batch_goes_before_its_head(self, policy: EvictionPolicy) -> None:
        # A LOOKUP reads a prefix, chunk 0 first.  Whatever a read moves (recency, a
        # promotion, a victim passed over and taken back into use), the prefix must still
        # be evicted from its tail: evicted from its head, the rest of it is unusable.
        prefix, others = make_keys(4), make_keys(36, start=100)
        policy.on_keys_written(prefix)
        policy.on_keys_written(others)  # pushes the prefix on (out of a small queue, say)
        policy.on_keys_read(prefix)
        offered = list(policy.victims())
        policy.on_keys_removed([])  # a walk that evicted nothing: every victim was locked
        positions = [offered.index(key) for key in reversed(prefix)]
        assert positions == sorted(positions), "after a read, the head of the prefix goes first"
        policy.on_keys_written(others[:1])  # another request between the two reads
        policy.on_keys_read(prefix)
        offered = list(policy.victims())
        positions = [offered.index(key) for key in reversed(prefix)]
        assert positions == sorted(positions), "after a read of victims passed over, the head goes first"

    @requires(EVICTS)
    def test_removed_then_rewritten_key_is_offered_again(self, policy: EvictionPolicy) -> None:
        key = make_keys(1)
        policy.on_keys_written(key)
        policy.on_keys_removed(key)
        assert list(policy.victims()) == []
        policy.on_keys_written(key)
        assert list(policy.victims()) == key

    @requires(RECENCY)
    def test_read_keys_are_evicted_after_unread_ones(self, policy: EvictionPolicy) -> None:
        old, new = make_keys(3), make_keys(3, start=10)
        policy.on_keys_written(old)
        policy.on_keys_written(new)
        policy.on_keys_read(old)
        offered = list(policy.victims())
        assert max(offered.index(k) for k in new) < min(offered.index(k) for k in old)

    # -- the optional set_aside/put_back hooks (``EvictionPolicy``) ------------------------
    # L1 eviction calls ``set_aside`` once a walk is over (its removal report made) with the
    # read-locked keys the walk passed over, and ``put_back`` before a later walk with those
    # whose locks ended or that left L1, possibly again after a put_back that raised.

    def hooked_policy(self) -> Any:
        """The policy, or a skip when it has neither hook; one hook alone is a failure
        (L1 eviction would ignore it)."""
        policy = self.make_policy()
        set_aside, put_back = getattr(policy, "set_aside", None), getattr(policy, "put_back", None)
        assert callable(set_aside) == callable(put_back), "set_aside and put_back go together"
        if not callable(set_aside):
            pytest.skip(f"{self.component_name} does not implement set_aside/put_back")
        return policy

    def walk_passing_over(self, policy: Any, count: int) -> list[ObjectKey]:
        """A full walk as L1 makes it when its first ``count`` victims are locked and no
        other is evicted; returns the keys it set aside."""
        walk = list(policy.victims())
        policy.on_keys_removed([])  # the report that ends a walk that removed nothing
        passed = walk[:count]
        policy.set_aside(passed)
        return passed

    def test_keys_set_aside_are_not_offered_until_put_back(self) -> None:
        policy = self.hooked_policy()
        keys = make_keys(8)
        policy.on_keys_written(keys)
        passed = self.walk_passing_over(policy, 3)
        for _ in range(2):  # set aside, the next walks leave them out
            offered = list(policy.victims())
            policy.on_keys_removed([])
            assert not set(offered) & set(passed), "a key set aside is offered"
            if self.evicts():
                assert_offered_once(offered, set(keys) - set(passed), "keys not set aside")
        policy.put_back(passed[1:2])
        offered = list(policy.victims())
        policy.on_keys_removed([])
        assert passed[1] in offered, "a key put back is not offered"
        assert not {passed[0], passed[2]} & set(offered), "a key still set aside is offered"
        policy.put_back(passed)
        if self.evicts():
            assert_offered_once(list(policy.victims()), keys, "every key put back")

    def test_put_back_ignores_keys_it_does_not_hold_aside(self) -> None:
        policy = self.hooked_policy()
        keys = make_keys(6)
        policy.on_keys_written(keys)
        before = list(policy.victims())
        policy.on_keys_removed([])
        # keys never written, and live keys that were never set aside
        policy.put_back([*make_keys(2, start=100), keys[0], keys[3]])
        assert list(policy.victims()) == before, "put_back of keys not set aside changed the walk"

    def test_the_same_keys_put_back_twice_are_offered_once(self) -> None:
        policy = self.hooked_policy()
        keys = make_keys(6)
        policy.on_keys_written(keys)
        passed = self.walk_passing_over(policy, 2)
        policy.put_back(passed)
        once = list(policy.victims())
        policy.on_keys_removed([])
        policy.put_back(list(reversed(passed)))  # given again, as after a put_back that raised
        assert list(policy.victims()) == once, "a repeated put_back changed the walk"
        if self.evicts():
            assert_offered_once(once, keys, "keys put back twice")

    def test_setting_aside_a_key_twice_or_a_removed_key_is_harmless(self) -> None:
        policy = self.hooked_policy()
        keys = make_keys(6)
        policy.on_keys_written(keys)
        passed = self.walk_passing_over(policy, 2)
        policy.set_aside(passed)  # L1 may pass over a key it already set aside
        policy.on_keys_removed(passed[:1])
        policy.set_aside(passed[:1])  # removed meanwhile: nothing to set aside
        policy.put_back(passed)
        offered = list(policy.victims())
        assert passed[0] not in offered, "a removed key came back with put_back"
        if self.evicts():
            assert_offered_once(offered, set(keys) - {passed[0]}, "after repeated set_aside")

    def test_a_key_read_or_rewritten_while_set_aside_is_offered_once(self) -> None:
        # A read or write may bring a key set aside back into the order (the docs): a
        # put_back that follows must not make it a second entry, nor lose it.
        for event in ("on_keys_read", "on_keys_written"):
            policy = self.hooked_policy()
            keys = make_keys(6)
            policy.on_keys_written(keys)
            passed = self.walk_passing_over(policy, 2)
            getattr(policy, event)(passed[:1])
            offered = list(policy.victims())
            policy.on_keys_removed([])
            assert passed[1] not in offered, f"{event} of another key brought a key set aside back"
            policy.put_back(passed)
            offered = list(policy.victims())
            policy.on_keys_removed([])
            if self.evicts():
                assert_offered_once(offered, keys, f"{event} while set aside, then put back")

    def test_a_key_removed_while_set_aside_is_forgotten(self) -> None:
        policy = self.hooked_policy()
        keys = make_keys(6)
        policy.on_keys_written(keys)
        passed = self.walk_passing_over(policy, 2)
        policy.on_keys_removed(passed[:1])  # deleted by force, or lost to a disk error
        policy.put_back(passed)  # L1 gives back the keys that left it too
        offered = list(policy.victims())
        policy.on_keys_removed([])
        assert passed[0] not in offered, "a key removed while set aside is offered"
        if self.evicts():
            assert_offered_once(offered, set(keys) - {passed[0]}, "after a removal while set aside")
        policy.on_keys_written(passed[:1])  # written again: a live key like any other
        if self.evicts():
            assert_offered_once(list(policy.victims()), keys, "a key rewritten after its removal")

    @pytest.mark.parametrize("seed", range(4))
    def test_walks_are_the_policys_own_without_the_keys_set_aside(self, seed: int) -> None:
        self.hooked_policy()
        check_set_aside_against_reference(self.make_policy, seed, held_aside=self.held_aside())

    def test_l1_walks_past_each_locked_object_once(self) -> None:
        # A real L1 and its eviction controller, driven by hand: most objects read-locked,
        # wherever the policy puts them.  Each write evicts one unlocked object; the walks
        # pass each locked one once in all (then it is set aside), not on every write.
        self.hooked_policy()
        from lmcache_tiers.controllers.l1_eviction import L1EvictionController
        from lmcache_tiers.controllers.stats import EngineStats
        from lmcache_tiers.l1 import L1Manager

        align, blocks, locked_count, writes = 4096, 64, 40, 16
        policy = _CountingWalks(self.make_policy())
        l1 = L1Manager(blocks * align, align=align, prefault=False)
        stats = EngineStats(0)
        controller = L1EvictionController(l1, policy, trigger_watermark=0.99, eviction_ratio=0.1, stats=stats)
        try:
            keys = make_keys(blocks)
            locked = set(keys[::2][: locked_count // 2] + keys[1::2][: locked_count // 2])
            l1.reserve_write(keys, [align] * blocks)
            for key in keys:  # one by one, locked ones among the others
                finish = l1.finish_write_and_reserve_read if key in locked else l1.finish_write
                assert finish([key]) == [True]
            for index in range(writes):
                assert controller.evict_now(align) == align
                new = make_keys(1, start=blocks + index)
                l1.reserve_write(new, [align])
                assert l1.finish_write(new) == [True]
            assert all(l1.contains(key) for key in locked), "a locked object was evicted"
            assert policy.offered <= locked_count + writes, (
                f"{policy.offered} keys offered for {writes} writes past {locked_count} locked objects"
            )
            assert stats.failures() == {}
        finally:
            controller.finish()
            l1.close()

    def held_aside(self) -> Callable[[Any], Iterable[ObjectKey]] | None:
        """For a policy that ignores some reads or writes (so a key set aside they name may
        stay aside): a function naming the keys a policy holds aside.  None: every read
        and write is a use (``check_set_aside_against_reference``)."""
        return None


Suite = TypeVar("Suite", bound=_PolicySuite)

#: the name a policy under a test of a suite itself is registered by
PROBE = "probe"


def probe_suite(suite: type[Suite], policy: type[Any], capabilities: frozenset[str] = frozenset()) -> Suite:
    """``suite`` on ``policy`` (registered alone as "probe", with no config), declaring
    ``capabilities``: for the tests of a suite itself, which must fail a policy broken the
    way it checks and pass a sound one."""

    def registry(self: object) -> ComponentRegistry:
        built = ComponentRegistry()
        built.for_plugin(suite.kind, PROBE).add(PROBE, policy, EmptyConfig)
        return built

    members = {"component_name": PROBE, "capabilities": capabilities, "registry": registry}
    return cast(Suite, type(f"Probe{suite.__name__}", (suite,), members)())
