"""What the prefetch controller does with a prefetch policy's bugs, next to ``default``,
the policy that has none: a plan that names an adapter nobody asked, or that is not a
plan at all, costs hits -- counted and logged, never passed over unseen -- and never
leaves locks, pins or reservations behind."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.policies import plan_from_lowest_index
from lmcache_tiers.registry import ComponentRegistry, KindRegistry
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.registries import plugins_with

SIZE = 64 * 1024


class BuggyPrefetchPolicy:
    """Answers ``select_load_plan`` with whatever ``answer(keys, found, adapters)`` returns."""

    retain_loaded = False
    answer: Any = staticmethod(plan_from_lowest_index)

    def __init__(self, config: object) -> None:
        pass

    def select_load_plan(self, keys: Sequence[ObjectKey], found: Any, adapters: Any) -> Any:
        return BuggyPrefetchPolicy.answer(keys, found, adapters)


@hookimpl
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    registry.add("buggy", BuggyPrefetchPolicy)


def buggy_registry() -> ComponentRegistry:
    return plugins_with(
        "prefetch-policy-bug-tests", tiers_register_prefetch_policies=tiers_register_prefetch_policies
    ).registry


@pytest.fixture
def storage(request: pytest.FixtureRequest) -> Iterator[StorageManager]:
    registry = buggy_registry()
    adapter = decode_adapter(registry, {"type": "mock", "namespace": f"prefetch-bugs-{request.node.name}"}, 0)
    config = ServerConfig(l1_size_gb=1 / 64, l2_adapters=(adapter,), l2_prefetch_policy="buggy")
    built = StorageManager(config, registry)
    yield built
    built.close()
    BuggyPrefetchPolicy.answer = staticmethod(plan_from_lowest_index)


def keys_of(count: int) -> list[ObjectKey]:
    return [ObjectKey("prefetch-policy-bugs", 0, index.to_bytes(8, "big")) for index in range(count)]


def in_l2_only(storage: StorageManager, keys: Sequence[ObjectKey]) -> None:
    """``keys`` written, stored to L2, then evicted from L1."""
    reserved = storage.reserve_write(keys, [SIZE] * len(keys))
    for index, obj in enumerate(reserved.values()):
        storage.view(obj)[:] = bytes([index]) * SIZE
    assert all(storage.commit_write(keys))
    assert storage.flush(10)
    assert storage.evict(keys) == len(keys)


def prefetch(storage: StorageManager, keys: Sequence[ObjectKey]) -> int:
    handle = storage.submit_prefetch(keys)
    hits = storage.wait_prefetch(handle, 10)
    assert hits is not None, "the prefetch did not finish"
    return hits


def settles_clean(storage: StorageManager, keys: Sequence[ObjectKey], hits: int) -> None:
    """The hits are readable and hold the bytes written; once released, nothing is left
    locked, pinned or reserved: a second prefetch with a sound plan finds everything."""
    for index, obj in enumerate(storage.read(keys[:hits])):
        assert bytes(storage.view(obj)) == bytes([index]) * SIZE
    storage.release(keys[:hits])
    assert storage.adapters[0].pinned(keys) == [False] * len(keys)
    BuggyPrefetchPolicy.answer = staticmethod(plan_from_lowest_index)
    assert prefetch(storage, keys) == len(keys)
    storage.release(keys)


def test_the_sound_plan_loads_everything(storage: StorageManager) -> None:
    keys = keys_of(4)
    in_l2_only(storage, keys)
    assert prefetch(storage, keys) == 4
    assert storage.status()["failures"] == {}
    settles_clean(storage, keys, 4)


@pytest.mark.parametrize("index", [5, -1])
def test_an_adapter_that_does_not_exist_is_counted(storage: StorageManager, index: int) -> None:
    keys = keys_of(4)
    in_l2_only(storage, keys)
    BuggyPrefetchPolicy.answer = staticmethod(lambda keys, found, adapters: {index: [True] * len(keys)})
    assert prefetch(storage, keys) == 0
    assert storage.status()["failures"] == {"prefetch_policy_bad_adapter": 4}
    settles_clean(storage, keys, 0)


def test_keys_planned_from_a_missing_adapter_end_the_prefix(storage: StorageManager) -> None:
    keys = keys_of(4)
    in_l2_only(storage, keys)
    BuggyPrefetchPolicy.answer = staticmethod(
        lambda keys, found, adapters: {0: [True, True, False, True], 3: [False, False, True, False]}
    )
    assert prefetch(storage, keys) == 2
    assert storage.status()["failures"] == {"prefetch_policy_bad_adapter": 1}
    settles_clean(storage, keys, 2)


def test_an_unknown_adapter_planned_nothing_is_not_counted(storage: StorageManager) -> None:
    keys = keys_of(4)
    in_l2_only(storage, keys)

    def plan(keys: Sequence[ObjectKey], found: Any, adapters: Any) -> Any:
        return {**plan_from_lowest_index(keys, found, adapters), 7: [False] * len(keys)}

    BuggyPrefetchPolicy.answer = staticmethod(plan)
    assert prefetch(storage, keys) == 4
    assert storage.status()["failures"] == {}
    settles_clean(storage, keys, 4)


def test_a_numpy_bitmap_is_a_plan(storage: StorageManager) -> None:
    keys = keys_of(4)
    in_l2_only(storage, keys)
    BuggyPrefetchPolicy.answer = staticmethod(lambda keys, found, _: {0: np.ones(len(keys), dtype=bool)})
    assert prefetch(storage, keys) == 4
    assert storage.status()["failures"] == {}
    settles_clean(storage, keys, 4)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda keys, found, adapters: 1 / 0, id="raises"),
        pytest.param(lambda keys, found, adapters: [[True] * len(keys)], id="a-list-not-a-dict"),
        pytest.param(lambda keys, found, adapters: {0: None}, id="none-for-a-bitmap"),
        pytest.param(lambda keys, found, adapters: {"0": [True] * len(keys)}, id="index-not-an-int"),
        pytest.param(lambda keys, found, adapters: {True: [True] * len(keys)}, id="index-a-bool"),
        pytest.param(lambda keys, found, adapters: {0: [True] * (len(keys) - 1)}, id="bitmap-too-short"),
        pytest.param(lambda keys, found, adapters: {0: [True] * (len(keys) + 1)}, id="bitmap-too-long"),
        pytest.param(lambda keys, found, adapters: {0: [1] * len(keys)}, id="flags-not-booleans"),
        pytest.param(lambda keys, found, adapters: {0: "1111"}, id="a-string"),
    ],
)
def test_a_raising_or_malformed_plan_is_counted(storage: StorageManager, answer: Any) -> None:
    keys = keys_of(4)
    in_l2_only(storage, keys)
    BuggyPrefetchPolicy.answer = staticmethod(answer)
    assert prefetch(storage, keys) == 0
    assert storage.status()["failures"] == {"prefetch_policy_error": 1}
    settles_clean(storage, keys, 0)


def emptying_the_keys(keys: Any, found: Any, adapters: Any) -> Any:
    plan = plan_from_lowest_index(keys, found, adapters)
    del keys[:]
    return plan


def reversing_the_keys(keys: Any, found: Any, adapters: Any) -> Any:
    plan = {0: [True] + [False] * (len(keys) - 1)}  # the first key only
    keys.reverse()
    return plan


@pytest.mark.parametrize("answer", [emptying_the_keys, reversing_the_keys])
def test_a_policy_writing_to_its_arguments_changes_its_plan_only(
    storage: StorageManager, answer: Any
) -> None:
    """A policy is handed the request's keys and lookup answers to read; one that writes
    to them (a failed attempt, which is counted, or a plan that succeeded) must not change
    what the controller later unlocks and unclaims: a later prefetch of the same keys would
    wait for a claim nobody gives back, and a read lock would outlive its reader."""
    keys = keys_of(4)
    in_l2_only(storage, keys)
    BuggyPrefetchPolicy.answer = staticmethod(answer)
    hits = prefetch(storage, keys)
    assert storage.l1.stats().read_locks == hits, "the prefix is locked once per key, no more"
    storage.release(keys[:hits])
    assert storage.l1.stats().read_locks == 0
    settles_clean(storage, keys, 0)


class UnanswerableRetain(BuggyPrefetchPolicy):
    @property
    def retain_loaded(self) -> bool:  # type: ignore[override]
        raise RuntimeError("retain_loaded cannot be read")


@hookimpl(specname="tiers_register_prefetch_policies")
def register_unanswerable(registry: KindRegistry) -> None:
    registry.add("unanswerable-retain", UnanswerableRetain)


def test_a_retain_loaded_that_raises_is_the_policys_error(request: pytest.FixtureRequest) -> None:
    """Counted as the policy's failure, as a plan that raises is, not as a fault of the
    controller's own (``prefetch_internal_error``)."""
    registry = plugins_with(
        "prefetch-policy-retain-bug-tests", tiers_register_prefetch_policies=register_unanswerable
    ).registry
    adapter = decode_adapter(registry, {"type": "mock", "namespace": f"prefetch-bugs-{request.node.name}"}, 0)
    config = ServerConfig(l1_size_gb=1 / 64, l2_adapters=(adapter,), l2_prefetch_policy="unanswerable-retain")
    storage = StorageManager(config, registry)
    try:
        keys = keys_of(4)
        in_l2_only(storage, keys)
        assert prefetch(storage, keys) == 0
        assert storage.status()["failures"] == {"prefetch_policy_error": 1}
        assert storage.adapters[0].pinned(keys) == [False] * len(keys)
        assert storage.l1.stats().read_locks == 0
        assert len(storage.l1) == 0, "nothing was reserved for the loads"
    finally:
        storage.close()
