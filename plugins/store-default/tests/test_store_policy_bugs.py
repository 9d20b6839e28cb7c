"""What the store controller does with a store policy's bugs, next to ``default``, the
policy that has none: a third-party policy's bug must cost no acknowledged write silently,
and must not leave objects flagged as waiting for a store that will never come."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.registry import ComponentRegistry, KindRegistry
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.registries import plugins_with

SIZE = 64 * 1024


class BuggyStorePolicy:
    """Answers ``select_store_targets`` with whatever ``answer(keys)`` returns."""

    answer: Any = staticmethod(lambda keys: {0: list(keys)})
    deletions: Any = staticmethod(lambda keys: [])

    def __init__(self, config: object) -> None:
        pass

    def select_store_targets(self, keys: Sequence[ObjectKey], adapters: Any) -> Any:
        return BuggyStorePolicy.answer(keys)

    def select_l1_deletions(self, keys: Sequence[ObjectKey]) -> Any:
        return BuggyStorePolicy.deletions(keys)


@hookimpl
def tiers_register_store_policies(registry: KindRegistry) -> None:
    registry.add("buggy", BuggyStorePolicy)


def buggy_registry() -> ComponentRegistry:
    return plugins_with(
        "store-policy-bug-tests", tiers_register_store_policies=tiers_register_store_policies
    ).registry


@pytest.fixture
def storage(request: pytest.FixtureRequest) -> Iterator[StorageManager]:
    registry = buggy_registry()
    adapter = decode_adapter(registry, {"type": "mock", "namespace": f"store-bugs-{request.node.name}"}, 0)
    config = ServerConfig(l1_size_gb=1 / 64, l2_adapters=(adapter,), l2_store_policy="buggy")
    built = StorageManager(config, registry)
    yield built
    built.close()
    BuggyStorePolicy.answer = staticmethod(lambda keys: {0: list(keys)})
    BuggyStorePolicy.deletions = staticmethod(lambda keys: [])


def keys_of(count: int) -> list[ObjectKey]:
    return [ObjectKey("store-policy-bugs", 0, index.to_bytes(8, "big")) for index in range(count)]


def write(storage: StorageManager, keys: Sequence[ObjectKey]) -> None:
    reserved = storage.reserve_write(keys, [SIZE] * len(keys))
    for obj in reserved.values():
        storage.view(obj)[:] = b"w" * SIZE
    assert all(storage.commit_write(keys))


def stored_in_l2(storage: StorageManager) -> set[ObjectKey]:
    return set(storage.adapters[0].iter_keys())


def test_an_unknown_adapter_is_counted_and_the_known_one_still_stores(storage: StorageManager) -> None:
    BuggyStorePolicy.answer = staticmethod(lambda keys: {0: list(keys), 5: list(keys)})
    keys = keys_of(3)
    write(storage, keys)
    assert storage.flush(10)
    assert storage.status()["failures"] == {"store_policy_bad_adapter": 3}
    assert stored_in_l2(storage) == set(keys)
    assert storage.l1.unstored() == []


def test_keys_it_was_not_given_and_repeats_are_stored_once(storage: StorageManager) -> None:
    strangers = keys_of(6)[3:]
    BuggyStorePolicy.answer = staticmethod(lambda keys: {0: [*keys, *keys, *strangers]})
    keys = keys_of(3)
    write(storage, keys)
    assert storage.flush(10)
    assert stored_in_l2(storage) == set(keys)
    assert storage.status()["adapters"][0]["keys_stored"] == 3
    assert storage.status()["failures"] == {"store_policy_bad_key": 3}, "the strangers went uncounted"


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda keys: {}, id="nowhere"),
        pytest.param(lambda keys: {0: list(keys)[:1]}, id="some-nowhere"),
    ],
)
def test_keys_sent_nowhere_are_counted_as_left_in_l1(storage: StorageManager, answer: Any) -> None:
    # Committed for L2, kept in L1 only by the policy's choice: once L1 evicts them they
    # are gone, so the choice is counted (and logged), never silent.
    BuggyStorePolicy.answer = staticmethod(answer)
    keys = keys_of(3)
    write(storage, keys)
    assert storage.flush(10)
    untargeted = len(keys) - len(stored_in_l2(storage))
    assert untargeted > 0
    assert storage.status()["failures"] == {"store_policy_untargeted": untargeted}
    assert storage.l1.unstored() == []


def test_deletions_it_was_not_given_are_not_deleted(storage: StorageManager) -> None:
    bystanders = keys_of(6)[3:]
    write(storage, bystanders)
    assert storage.flush(10)
    BuggyStorePolicy.deletions = staticmethod(lambda keys: [*keys, *bystanders])
    keys = keys_of(3)
    write(storage, keys)
    assert storage.flush(10)
    assert [storage.l1.contains(key) for key in keys] == [False] * 3
    assert all(storage.l1.contains(key) for key in bystanders)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda keys: 1 / 0, id="raises"),
        pytest.param(lambda keys: [list(keys)], id="a-list-not-a-dict"),
        pytest.param(lambda keys: {0: None}, id="none-for-keys"),
        pytest.param(lambda keys: {"0": list(keys)}, id="index-not-an-int"),
        pytest.param(lambda keys: {0: [list(keys)]}, id="unhashable-key"),
    ],
)
def test_a_raising_or_malformed_policy_is_counted(storage: StorageManager, answer: Any) -> None:
    BuggyStorePolicy.answer = staticmethod(answer)
    keys = keys_of(3)
    write(storage, keys)
    assert storage.flush(10)
    assert storage.status()["failures"] == {"store_policy_error": 1}
    assert all(storage.l1.contains(key) for key in keys)
    assert storage.l1.unstored() == [], "nothing will store them: they must not wait for it"


def test_the_default_policy_sends_every_key_somewhere_and_trips_no_policy_counter(
    request: pytest.FixtureRequest,
) -> None:
    # The counters for a policy's strays and keys sent nowhere are for buggy policies:
    # ``default``, with two adapters and repeated batches, must never trip them.
    registry = buggy_registry()
    namespace = f"store-default-{request.node.name}"
    adapters = tuple(
        decode_adapter(registry, {"type": "mock", "namespace": f"{namespace}-{index}"}, index)
        for index in range(2)
    )
    storage = StorageManager(ServerConfig(l1_size_gb=1 / 64, l2_adapters=adapters), registry)
    try:
        keys = keys_of(6)
        write(storage, keys[:3])
        write(storage, keys[3:])
        assert storage.flush(10)
        for adapter in storage.adapters:
            assert set(adapter.iter_keys()) == set(keys)
        assert storage.status()["failures"] == {}
    finally:
        storage.close()
