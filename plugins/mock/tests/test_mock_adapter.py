"""The mock adapter against the L2 conformance suite, plus its own knobs and memory pool."""

from __future__ import annotations

import mmap
import threading
import uuid
from typing import Any

import msgspec
import pytest
from lmcache_plugin_mock import MockConfig
from lmcache_plugin_mock import backend as backend_module
from lmcache_plugin_mock.backend import MockBackend

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.l2.buffers import copy_into
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import (
    CAPACITY,
    EVICTION,
    IMMEDIATE_HITS,
    IMMEDIATE_MISSES,
    PERSISTENCE,
    L2AdapterSuite,
    make_keys,
    pattern,
)
from lmcache_tiers.testing.threads import joined


class TestMockAdapter(L2AdapterSuite):
    component_name = "mock"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, IMMEDIATE_MISSES, IMMEDIATE_HITS})

    def make_config(self) -> MockConfig:
        # 256 KiB: the capacity tests fill it with 16 objects of 16 KiB
        return MockConfig(max_size_gb=1 / 4096, namespace=uuid.uuid4().hex)


def test_config_is_decoded_from_an_adapter_spec() -> None:
    spec = decode_adapter(
        load_registry(), {"type": "mock", "max_size_gb": 2, "latency_s": 0.001, "namespace": "x"}, 0
    )
    assert spec.type == "mock"
    assert spec.config == MockConfig(max_size_gb=2.0, latency_s=0.001, namespace="x")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_size_gb", 0),
        ("max_size_gb", 1e-12),  # under one byte: every store would be refused
        ("bandwidth_bytes_per_s", -1),
        ("latency_s", -0.5),
        ("namespace", ""),
        ("namespace", "n" * 129),
        ("mock_bandwidth_gb", 5e-10),
    ],
)
def test_bad_config_is_refused_with_its_path(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf" - at `\$\.l2_adapters\[3\]\.{field}`$"):
        decode_adapter(load_registry(), {"type": "mock", field: value}, 3)


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown field `nonsense`"):
        decode_adapter(load_registry(), {"type": "mock", "nonsense": 1}, 3)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        MockConfig().max_size_gb = 2.0  # type: ignore[misc]
    assert msgspec.json.decode(b'{"max_size_gb": 0.5}', type=MockConfig).max_size_gb == 0.5


def make_mock(config: MockConfig) -> BackendAdapter:
    adapter = create_adapter(MockBackend, config, AdapterContext(index=0, name="0:mock", config=config))
    assert isinstance(adapter, BackendAdapter)
    return adapter


def backend_of(adapter: BackendAdapter) -> MockBackend:
    backend = adapter.backend
    assert isinstance(backend, MockBackend)
    return backend


def stored_bytes(backend: MockBackend) -> int:
    with backend._objects.lock:
        return sum(obj.size for obj in backend._objects.data.values())


def test_simulated_bandwidth_still_moves_the_bytes() -> None:
    adapter = make_mock(MockConfig(bandwidth_bytes_per_s=50 << 20, latency_s=0.0005))
    try:
        client = BlockingAdapterClient(adapter, timeout=30)
        keys = make_keys(2)
        data = [bytes([1]) * 4096, bytes([2]) * 8192]
        assert client.store(keys, [memoryview(d) for d in data]) == [True, True]
        buffers = [memoryview(bytearray(4096)), memoryview(bytearray(8192))]
        assert client.lookup_and_lock(keys).sizes == [4096, 8192]
        assert client.load(keys, buffers) == [True, True]
        assert [bytes(b) for b in buffers] == data
    finally:
        adapter.close()


def test_close_interrupts_a_slow_simulated_transfer() -> None:
    # 1 byte/s: the store would take hours unless close() cuts the simulated transfer short
    adapter = make_mock(MockConfig(bandwidth_bytes_per_s=1))
    task_id = adapter.submit_store(make_keys(1), [memoryview(b"x" * 100_000)])
    adapter.close()
    assert adapter.pop_completed_stores() == {task_id: [False]}


def test_namespaces_share_objects() -> None:
    namespace = uuid.uuid4().hex
    first = make_mock(MockConfig(namespace=namespace))
    second = make_mock(MockConfig(namespace=namespace))
    other = make_mock(MockConfig(namespace=uuid.uuid4().hex))
    try:
        keys = make_keys(1)
        assert BlockingAdapterClient(first).store(keys, [memoryview(b"abc")]) == [True]
        assert BlockingAdapterClient(second).lookup_and_lock(keys).sizes == [3]
        assert BlockingAdapterClient(other).lookup_and_lock(keys).found == [False]
    finally:
        for adapter in (first, second, other):
            adapter.close()


class TestMockAdapterPool(TestMockAdapter):
    """The same suite with objects large enough to live in the memory pool."""

    object_size = 128 << 10

    def make_config(self) -> MockConfig:
        # 2 MiB: the capacity tests fill it with 16 objects of 128 KiB
        return MockConfig(max_size_gb=1 / 512, namespace=uuid.uuid4().hex)


POOLED = 256 << 10  # comfortably above the size from which objects go to the pool


def pool_of(adapter: BackendAdapter) -> Any:
    pool = backend_of(adapter)._objects.pool
    assert pool is not None
    return pool


def test_large_objects_live_in_the_pool_and_small_ones_on_the_heap() -> None:
    adapter = make_mock(MockConfig(max_size_gb=1 / 256))
    try:
        client = BlockingAdapterClient(adapter, timeout=30)
        keys = make_keys(2)
        data = [pattern(1, POOLED), pattern(2, 1000)]
        assert client.store(keys, [memoryview(d) for d in data]) == [True, True]
        assert pool_of(adapter).allocator.allocated_bytes == POOLED
        assert adapter.used_bytes() == POOLED + 1000
        buffers = [memoryview(bytearray(len(d))) for d in data]
        assert client.lookup_and_lock(keys).found == [True, True]
        assert client.load(keys, buffers) == [True, True]
        adapter.unlock(keys)
        assert [bytes(b) for b in buffers] == data
        assert adapter.delete(keys) == [True, True]
        assert pool_of(adapter).allocator.allocated_bytes == 0
    finally:
        adapter.close()
    assert backend_of(adapter)._objects.pool is None, "closing an adapter without a namespace drops its pool"


def test_an_extent_being_loaded_is_not_reused_until_the_load_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = make_mock(MockConfig(max_size_gb=1 / 1024))  # 1 MiB: room for 4 objects
    backend = backend_of(adapter)
    try:
        keys = make_keys(4)
        old = pattern(1, POOLED)
        assert backend.put_many(keys[:1], [memoryview(old)]) == [True]
        pool = pool_of(adapter)
        during_load: list[bool] = []

        def copy_after_racing_writers(target: memoryview, source: bytes | bytearray | memoryview) -> None:
            if not during_load:
                # The load has claimed the object: replace and delete it, and store more
                # (best fit would put them into its extent were it free) before its bytes
                # are copied out.
                during_load.append(True)
                assert backend.put_many(keys[:1], [memoryview(pattern(2, POOLED))]) == [True]
                assert backend.delete_many(keys[:1]) == [True]
                fillers = [memoryview(pattern(3 + i, POOLED)) for i in range(3)]
                assert backend.put_many(keys[1:], fillers) == [True, True, True]
                assert pool.allocator.allocated_bytes == 4 * POOLED, "the loaded extent must be held"
            copy_into(target, source)

        monkeypatch.setattr(backend_module, "copy_into", copy_after_racing_writers)
        buffer = memoryview(bytearray(POOLED))
        assert backend.get_many_into(keys[:1], [buffer]) == [True]
        assert bytes(buffer) == old
        assert pool.allocator.allocated_bytes == 3 * POOLED, "freed once the load finished"
        assert stored_bytes(backend) == 3 * POOLED
    finally:
        adapter.close()


def test_objects_the_pool_cannot_hold_go_to_the_heap() -> None:
    # The pool is sized by the first adapter of a namespace; a larger one sharing it
    # still stores up to its own capacity.
    namespace = uuid.uuid4().hex
    small = make_mock(MockConfig(max_size_gb=1 / 2048, namespace=namespace))  # 512 KiB pool
    large = make_mock(MockConfig(max_size_gb=1 / 256, namespace=namespace))
    try:
        client = BlockingAdapterClient(large, timeout=30)
        keys = make_keys(6)
        data = [pattern(i, POOLED) for i in range(6)]
        assert client.store(keys, [memoryview(d) for d in data]) == [True] * 6
        assert pool_of(large).allocator.allocated_bytes == 2 * POOLED
        buffers = [memoryview(bytearray(POOLED)) for _ in keys]
        assert client.lookup_and_lock(keys).found == [True] * 6
        assert client.load(keys, buffers) == [True] * 6
        large.unlock(keys)
        assert [bytes(b) for b in buffers] == data
    finally:
        small.close()
        large.close()


def test_a_namespace_fuller_than_the_capacity_refuses_stores_after_a_restart() -> None:
    namespace = uuid.uuid4().hex
    large = make_mock(MockConfig(max_size_gb=1 / 256, namespace=namespace))
    try:
        keys = make_keys(6)
        payloads = [memoryview(pattern(i, POOLED)) for i in range(6)]
        assert BlockingAdapterClient(large).store(keys, payloads) == [True] * 6
    finally:
        large.close()
    small = make_mock(MockConfig(max_size_gb=1 / 2048, namespace=namespace))  # 512 KiB
    try:
        assert small.used_bytes() == 6 * POOLED, "the start-up scan accounted the namespace"
        assert small.usage() > 1.0
        assert BlockingAdapterClient(small).store(make_keys(1, start=10), [payloads[0]]) == [False]
        assert small.stats()["capacity_refusals"] == 1
    finally:
        small.close()


def test_concurrent_stores_of_the_same_keys_keep_the_pool_exact() -> None:
    adapter = make_mock(MockConfig(max_size_gb=1 / 64))
    backend = backend_of(adapter)
    keys = make_keys(4)
    payloads = [memoryview(pattern(i, POOLED + i * 4096)) for i in range(4)]

    def store_repeatedly() -> None:
        for _ in range(50):
            assert backend.put_many(keys, payloads) == [True] * 4

    try:
        threads = [threading.Thread(target=store_repeatedly, daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            joined(thread, "concurrent put_many of the same keys")
        assert stored_bytes(backend) == sum(p.nbytes for p in payloads)
        extents = sum(pool_of(adapter).allocator.extent_size(p.nbytes) for p in payloads)
        assert pool_of(adapter).allocator.allocated_bytes == extents
    finally:
        adapter.close()


def test_prefault_populates_the_pool_at_start() -> None:
    config = msgspec.json.decode(b'{"max_size_gb": 0.001, "prefault": true}', type=MockConfig)
    adapter = make_mock(config)
    try:
        data = pattern(5, POOLED)
        client = BlockingAdapterClient(adapter, timeout=30)
        assert client.store(make_keys(1), [memoryview(data)]) == [True]
        buffer = memoryview(bytearray(POOLED))
        assert client.load(make_keys(1), [buffer]) == [True]
        assert bytes(buffer) == data
    finally:
        adapter.close()


def test_a_batch_storing_one_key_twice_keeps_the_last() -> None:
    adapter = make_mock(MockConfig(max_size_gb=1 / 1024))  # 1 MiB
    backend = backend_of(adapter)
    quarter = 256 << 10
    try:
        keys = make_keys(1)
        twice = [memoryview(pattern(20, quarter)), memoryview(pattern(21, quarter // 2))]
        assert backend.put_many([keys[0], keys[0]], twice) == [True, True]
        assert stored_bytes(backend) == quarter // 2
        assert pool_of(adapter).allocator.allocated_bytes == quarter // 2, "the first copy's extent is freed"
        assert backend.contains_many(keys) == [quarter // 2]
        buffer = memoryview(bytearray(quarter // 2))
        assert backend.get_many_into(keys, [buffer]) == [True]
        assert bytes(buffer) == bytes(twice[1])
    finally:
        adapter.close()


def test_a_failed_copy_leaves_objects_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = make_mock(MockConfig(max_size_gb=1 / 1024))
    backend = backend_of(adapter)
    try:
        keys = make_keys(2)
        old = pattern(1, POOLED)
        assert backend.put_many(keys[:1], [memoryview(old)]) == [True]
        copies: list[int] = []

        def fail_second_copy(target: memoryview, source: bytes | bytearray | memoryview) -> None:
            copies.append(1)
            if len(copies) == 2:
                raise OSError("simulated copy failure")
            copy_into(target, source)

        monkeypatch.setattr(backend_module, "copy_into", fail_second_copy)
        with pytest.raises(OSError, match="simulated"):
            backend.put_many(keys, [memoryview(pattern(2, POOLED // 2)), memoryview(pattern(3, POOLED))])
        monkeypatch.undo()
        assert stored_bytes(backend) == POOLED
        assert pool_of(adapter).allocator.allocated_bytes == POOLED
        buffer = memoryview(bytearray(POOLED))
        assert backend.get_many_into(keys[:1], [buffer]) == [True]
        assert bytes(buffer) == old
        assert backend.contains_many(keys) == [POOLED, None]
    finally:
        adapter.close()


def test_without_a_pool_every_object_goes_to_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    adapter = make_mock(MockConfig(max_size_gb=1 / 1024))
    monkeypatch.undo()
    backend = backend_of(adapter)
    try:
        assert backend._objects.pool is None
        data = pattern(9, POOLED)
        assert backend.put_many(make_keys(1), [memoryview(data)]) == [True]
        buffer = memoryview(bytearray(POOLED))
        assert backend.get_many_into(make_keys(1), [buffer]) == [True]
        assert bytes(buffer) == data
    finally:
        adapter.close()
