"""The mock adapter against the L2 conformance suite, plus its own knobs."""

from __future__ import annotations

import uuid

import msgspec
import pytest
from lmcache_plugin_mock import MockConfig
from lmcache_plugin_mock.adapter import MockAdapter

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2 import AdapterContext, BlockingAdapterClient
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.l2 import CAPACITY, EVICTION, PERSISTENCE, L2AdapterSuite, make_keys


class TestMockAdapter(L2AdapterSuite):
    component_name = "mock"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

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
        ("bandwidth_bytes_per_s", -1),
        ("latency_s", -0.5),
        ("namespace", ""),
        ("nonsense", 1),
    ],
)
def test_bad_config_is_refused_with_its_path(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field if field != "nonsense" else "unknown field"):
        decode_adapter(load_registry(), {"type": "mock", field: value}, 3)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        MockConfig().max_size_gb = 2.0  # type: ignore[misc]
    assert msgspec.json.decode(b'{"max_size_gb": 0.5}', type=MockConfig).max_size_gb == 0.5


def make_mock(config: MockConfig) -> MockAdapter:
    return MockAdapter(config, AdapterContext(index=0, name="0:mock", config=config))


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


def test_namespaces_share_objects_and_capacity() -> None:
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
