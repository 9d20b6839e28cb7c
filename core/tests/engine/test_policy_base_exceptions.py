"""A store, prefetch, L1 or L2 eviction policy that raises what is no ``Exception`` -- KeyboardInterrupt,
SystemExit, a BaseException of its own -- from the controller thread that consults it: a
bug of the plugin's (no signal is raised off the main thread).  It is counted and logged
as the policy's failure, like any exception it raises, and the controller goes on: a
policy's bug must not end the thread every later store or prefetch waits on."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from l2_backends import DictBackend, Fifo, open_dict

from lmcache_tiers.config import L2EvictionConfig, ServerConfig, decode_adapter
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.errors import plugin_walk
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.policies import plan_from_lowest_index
from lmcache_tiers.registry import ComponentRegistry, KindRegistry
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.registries import plugins_with

SIZE = 64 * 1024


class PluginAbort(BaseException):
    """A plugin's own exception that derives from BaseException."""


#: asyncio.CancelledError too: a policy is synchronous code, which no cancellation of
#: core's reaches (it is thrown in at an await), so one raised there is the policy's own
ERRORS = [KeyboardInterrupt(), SystemExit(4), PluginAbort("policy bug"), asyncio.CancelledError()]


class RaisingPolicies:
    """A store and a prefetch policy in one: sound until ``error`` is set, then raising it."""

    error: BaseException | None = None
    retain_loaded = False

    def __init__(self, config: object) -> None:
        pass

    @classmethod
    def _maybe_raise(cls) -> None:
        if cls.error is not None:
            raise cls.error

    def select_store_targets(self, keys: Sequence[ObjectKey], adapters: Any) -> Any:
        self._maybe_raise()
        return {0: list(keys)}

    def select_l1_deletions(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        return []

    def select_load_plan(self, keys: Sequence[ObjectKey], found: Any, adapters: Any) -> Any:
        self._maybe_raise()
        return plan_from_lowest_index(keys, found, adapters)


@hookimpl
def tiers_register_store_policies(registry: KindRegistry) -> None:
    registry.add("raising", RaisingPolicies)


@hookimpl
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    registry.add("raising", RaisingPolicies)


def raising_registry() -> ComponentRegistry:
    return plugins_with(
        "policy-base-exception-tests",
        tiers_register_store_policies=tiers_register_store_policies,
        tiers_register_prefetch_policies=tiers_register_prefetch_policies,
    ).registry


@pytest.fixture
def storage(request: pytest.FixtureRequest) -> Iterator[StorageManager]:
    registry = raising_registry()
    adapter = decode_adapter(registry, {"type": "mock", "namespace": f"policy-base-{request.node.name}"}, 0)
    config = ServerConfig(
        l1_size_gb=1 / 64, l2_adapters=(adapter,), l2_store_policy="raising", l2_prefetch_policy="raising"
    )
    built = StorageManager(config, registry)
    yield built
    RaisingPolicies.error = None
    built.close()


def keys_of(first: int, count: int) -> list[ObjectKey]:
    return [
        ObjectKey("policy-base-exceptions", 0, index.to_bytes(8, "big"))
        for index in range(first, first + count)
    ]


def write(storage: StorageManager, keys: Sequence[ObjectKey]) -> None:
    reserved = storage.reserve_write(keys, [SIZE] * len(keys))
    for index, obj in enumerate(reserved.values()):
        storage.view(obj)[:] = bytes([index]) * SIZE
    assert all(storage.commit_write(keys))


def prefetch(storage: StorageManager, keys: Sequence[ObjectKey]) -> int:
    handle = storage.submit_prefetch(keys)
    hits = storage.wait_prefetch(handle, 10)
    assert hits is not None, "the prefetch did not finish"
    return hits


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_a_store_policy_raising_a_base_exception_is_counted_and_stores_go_on(
    storage: StorageManager, error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_of(0, 3)
    RaisingPolicies.error = error
    with caplog.at_level(logging.WARNING):
        write(storage, keys)
        assert storage.flush(10)
    assert storage.status()["failures"] == {"store_policy_error": 1}
    assert any("store policy failed on 3 keys" in record.getMessage() for record in caplog.records)
    assert storage.l1.unstored() == [], "nothing will store them: they must not wait for it"
    RaisingPolicies.error = None
    later = keys_of(3, 2)
    write(storage, later)
    assert storage.flush(10)
    assert set(storage.adapters[0].iter_keys()) == set(later), "the store controller goes on"


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_a_prefetch_policy_raising_a_base_exception_is_counted_and_prefetches_go_on(
    storage: StorageManager, error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_of(0, 4)
    write(storage, keys)
    assert storage.flush(10)
    assert storage.evict(keys) == len(keys)
    RaisingPolicies.error = error
    with caplog.at_level(logging.WARNING):
        assert prefetch(storage, keys) == 0
    assert storage.status()["failures"] == {"prefetch_policy_error": 1}
    assert any("prefetch policy failed" in record.getMessage() for record in caplog.records)
    RaisingPolicies.error = None
    assert prefetch(storage, keys) == len(keys), "the prefetch controller goes on"
    for index, obj in enumerate(storage.read(keys)):
        assert bytes(storage.view(obj)) == bytes([index]) * SIZE
    storage.release(keys)
    storage.release(keys)


class RaisingVictims(Fifo):
    """An L2 eviction policy whose walk raises ``error`` when it is set."""

    error: BaseException | None = None

    def victims(self) -> Iterator[ObjectKey]:
        if self.error is not None:
            raise self.error
        yield from super().victims()


def on_a_thread(work: Any) -> None:
    """``work()`` off the main thread, as a controller's or a front end's thread runs it;
    nothing may escape it."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and outcome == [], outcome


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_an_l2_eviction_policy_raising_a_base_exception_is_counted_and_eviction_goes_on(
    error: BaseException,
) -> None:
    size, count = 1000, 8
    adapter = open_dict(DictBackend, capacity=count * size)
    try:
        policy = RaisingVictims()
        config = L2EvictionConfig(trigger_watermark=0.5, eviction_ratio=0.25)
        controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))
        controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
        keys = keys_of(0, count)
        client = BlockingAdapterClient(adapter)
        assert client.store(keys, [memoryview(bytearray(size)) for _ in keys]) == [True] * count
        policy.error = error
        on_a_thread(lambda: controller.evict(2 * size))
        assert controller.stats.failures()["l2_eviction_policy_error"] == 1
        assert len(list(adapter.iter_keys())) == count
        policy.error = None
        on_a_thread(lambda: controller.evict(2 * size))
        assert len(list(adapter.iter_keys())) == count - 2, "eviction goes on"
    finally:
        adapter.close()


class RaisingL1Policy(Fifo):
    """An L1 eviction policy raising ``error`` from the method named by ``raise_in``."""

    raise_in = ""
    error: BaseException = KeyboardInterrupt()

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        if self.raise_in == "on_keys_written":
            raise self.error
        super().on_keys_written(keys)

    def victims(self) -> Iterator[ObjectKey]:
        for key in super().victims():
            if self.raise_in == "victims":
                raise self.error
            yield key


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("method", ["on_keys_written", "victims"])
def test_an_l1_eviction_policy_raising_a_base_exception_is_counted_and_eviction_goes_on(
    method: str, error: BaseException
) -> None:
    align, blocks = 4096, 16
    l1 = L1Manager(blocks * align, align=align, prefault=False)
    try:
        policy = RaisingL1Policy()
        controller = L1EvictionController(
            l1, policy, trigger_watermark=0.9, eviction_ratio=0.25, stats=EngineStats(0)
        )
        keys = keys_of(0, 4)
        policy.raise_in, policy.error = method, error
        on_a_thread(lambda: (l1.reserve_write(keys, [align] * 4), l1.finish_write(keys)))
        if method == "victims":
            on_a_thread(lambda: controller.evict_now(align))
            assert all(l1.contains(key) for key in keys)
        assert controller.stats.failures()["l1_eviction_policy_error"] == 1
        policy.raise_in = ""
        later = keys_of(4, 2)
        l1.reserve_write(later, [align] * 2)
        l1.finish_write(later)
        assert controller.evict_now(align) == align, "eviction goes on"
    finally:
        l1.close()


def test_the_guarded_walk_of_victims_adds_no_python_call_per_key() -> None:
    """L1's ``make_room`` takes the policy's victims one at a time under the L1 lock, every
    reader and writer of L1 waiting: the guard around each step must cost next to nothing,
    not a context manager entered and left per key (a microsecond each, thousands of keys
    in one eviction)."""
    keys = keys_of(0, 1000)
    calls = 0

    def count_python_calls(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    walk = plugin_walk(keys)
    walked = 0
    sys.setprofile(count_python_calls)
    try:
        for _ in walk:  # a plain loop: no frame of the test's own per key
            walked += 1
    finally:
        sys.setprofile(None)
    assert walked == len(keys)
    # one resumption of the walk per key, and a few calls to start and end it
    assert calls <= len(keys) + 10, calls
