"""The L2 suite tells a backend that fails from one that is empty: an adapter answering
"absent" while its store is down would make core forget acknowledged writes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, L2Adapter
from lmcache_tiers.plugin import BACKEND_FAILURES, IMMEDIATE_HITS, IMMEDIATE_MISSES, L2AdapterSuite
from lmcache_tiers.registry import ComponentRegistry, KindRegistry
from lmcache_tiers.testing.l2_support import BufferPool, page_aligned_buffer
from lmcache_tiers.testing.registries import plugins_with


class StoreDown(ConnectionError):
    """What the backends here raise while their store is down."""


class MemoryConfig(L2AdapterConfig):
    """Objects in a dict that can be made to fail."""


class HonestMemory:
    """Raises while its store is down, as the plugin guide asks."""

    def __init__(self, config: MemoryConfig, context: Any) -> None:
        self.objects: dict[ObjectKey, bytes] = {}
        self.lock = threading.Lock()
        self.down = threading.Event()

    def _check_up(self) -> None:
        if self.down.is_set():
            raise StoreDown("the store does not answer")

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self._check_up()
        with self.lock:
            self.objects.update((key, bytes(payload)) for key, payload in zip(keys, payloads, strict=True))
        return [True] * len(keys)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        self._check_up()
        with self.lock:
            return [len(self.objects[key]) if key in self.objects else None for key in keys]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        self._check_up()
        loaded = []
        for key, buffer in zip(keys, buffers, strict=True):
            with self.lock:
                data = self.objects.get(key)
            fits = data is not None and len(data) == buffer.nbytes
            if fits:
                buffer[:] = data
            loaded.append(fits)
        return loaded

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._check_up()
        with self.lock:
            return [self.objects.pop(key, None) is not None for key in keys]

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self.lock:
            return [(key, len(data)) for key, data in self.objects.items()]

    def capacity(self) -> int:
        return 1 << 30


class HonestImmediateMemory(HonestMemory):
    """Answers lookups on the caller's thread too, and raises there while down."""

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        return self.contains_many(keys)


class AbsentWhenDown(HonestMemory):
    """The defect: a lookup that failed answers every key absent."""

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        try:
            return super().contains_many(keys)
        except StoreDown:
            return [None] * len(keys)


class AbsentNowWhenDown(HonestImmediateMemory):
    """The defect on the immediate path only: the worker's lookup raises."""

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        try:
            return super().contains_many_now(keys)
        except StoreDown:
            return [None] * len(keys)


class OtherBytesWhenDown(HonestMemory):
    """The defect on the load path: a load while down reports zeros as loaded."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        try:
            return super().get_many_into(keys, buffers)
        except StoreDown:
            for buffer in buffers:
                buffer[:] = bytes(buffer.nbytes)
            return [True] * len(keys)


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("suite_honest_memory", HonestMemory, MemoryConfig)
    registry.add("suite_honest_immediate_memory", HonestImmediateMemory, MemoryConfig)
    registry.add("suite_absent_when_down", AbsentWhenDown, MemoryConfig)
    registry.add("suite_absent_now_when_down", AbsentNowWhenDown, MemoryConfig)
    registry.add("suite_other_bytes_when_down", OtherBytesWhenDown, MemoryConfig)


class FailingMemorySuite(L2AdapterSuite):
    capabilities = frozenset({BACKEND_FAILURES})

    def registry(self) -> ComponentRegistry:
        return plugins_with("suite-failures", tiers_register_l2_adapters=tiers_register_l2_adapters).registry

    @contextlib.contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        assert isinstance(adapter, BackendAdapter)
        backend: HonestMemory = adapter.backend  # type: ignore[assignment]
        backend.down.set()
        try:
            yield
        finally:
            backend.down.clear()


class TestHonestMemory(FailingMemorySuite):
    """The suite (with the failure tests) passes an adapter that raises while down."""

    component_name = "suite_honest_memory"

    def test_discoverable_through_entry_point(self) -> None:
        pytest.skip("registered by this test module, not through an entry point")


class TestHonestImmediateMemory(FailingMemorySuite):
    """The failure test asks ``lookup_and_lock_now`` too, which raises here while down."""

    component_name = "suite_honest_immediate_memory"
    capabilities = frozenset({BACKEND_FAILURES, IMMEDIATE_MISSES, IMMEDIATE_HITS})

    def test_discoverable_through_entry_point(self) -> None:
        pytest.skip("registered by this test module, not through an entry point")


class InertFailureSuite(FailingMemorySuite):
    """The defect in a suite: its failing_storage() leaves the store working."""

    @contextlib.contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        yield


def run_failure_test(suite: L2AdapterSuite, component_name: str) -> None:
    """The suite's failure test on a fresh adapter of ``component_name``."""
    suite.component_name = component_name  # type: ignore[misc]
    l1_buffer = page_aligned_buffer(suite.l1_buffer_size)
    adapter = suite.open_adapter(suite.make_config(), l1_buffer)
    try:
        suite.test_a_failing_backend_is_not_taken_for_an_empty_one(adapter, BufferPool(l1_buffer))
    finally:
        adapter.close()


class TestTheSuiteCatchesFailuresTakenForSomethingElse:
    @pytest.mark.parametrize(
        ("component_name", "message"),
        [
            ("suite_absent_when_down", "absent"),
            ("suite_absent_now_when_down", "absent"),
            ("suite_other_bytes_when_down", "other bytes"),
        ],
    )
    def test_a_backend_answering_wrongly_while_down_fails_the_suite(
        self, component_name: str, message: str
    ) -> None:
        with pytest.raises(AssertionError, match=message):
            run_failure_test(FailingMemorySuite(), component_name)

    def test_a_failing_storage_that_fails_nothing_fails_the_suite(self) -> None:
        with pytest.raises(AssertionError, match="did not make the store fail"):
            run_failure_test(InertFailureSuite(), "suite_honest_memory")
