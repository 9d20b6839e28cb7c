"""fault_inject: conformance as a pass-through wrapper, then each kind of injected fault."""

from __future__ import annotations

import asyncio
import inspect
import logging
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import blake3
import pytest
from lmcache_plugin_fault_inject import FaultInjectConfig
from lmcache_plugin_fault_inject.backend import InnerLookupTimeout, gap_positions, open_fault_inject
from lmcache_plugin_mock import MockConfig
from lmcache_plugin_mock.backend import MockBackend

from lmcache_tiers.config import L2AdapterConfig, decode_adapter
from lmcache_tiers.errors import ConfigError, PartialFailure, PluginError
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, L2Adapter, L2Op, create_adapter
from lmcache_tiers.l2.circuit import PROBE_KEY, CircuitConfig
from lmcache_tiers.plugins import discover, load_registry
from lmcache_tiers.registry import KindRegistry
from lmcache_tiers.serde import Serde, SerdeContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import CAPACITY, EVICTION, PERSISTENCE, L2AdapterSuite, make_keys, pattern


def mock_spec(**extra: Any) -> dict[str, Any]:
    return {"type": "mock", "namespace": uuid.uuid4().hex, **extra}


class TestFaultInjectPassThrough(L2AdapterSuite):
    """With every rate at zero the wrapper must behave exactly like its inner adapter."""

    component_name = "fault_inject"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    def make_config(self) -> FaultInjectConfig:
        return FaultInjectConfig(inner=mock_spec(max_size_gb=1 / 4096))


def open_fault(serde: tuple[Serde, ...] = (), **settings: Any) -> BackendAdapter:
    settings.setdefault("inner", mock_spec())
    config = FaultInjectConfig(**settings)
    context = AdapterContext(index=0, name="0:fault_inject", config=config, serde=serde)
    adapter = create_adapter(open_fault_inject, config, context)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def inner_of(adapter: BackendAdapter) -> Any:
    """The wrapped backend, called directly."""
    return adapter.backend.inner  # type: ignore[attr-defined]


@pytest.fixture
def opened() -> Iterator[list[BackendAdapter]]:
    adapters: list[BackendAdapter] = []
    yield adapters
    for adapter in adapters:
        adapter.close()


def fill(adapter: BackendAdapter, keys: list[ObjectKey], size: int = 256) -> list[bytes]:
    """Store straight into the inner backend, bypassing injected store faults."""
    data = [pattern(i, size) for i in range(len(keys))]
    assert inner_of(adapter).put_many(keys, [memoryview(d) for d in data]) == [True] * len(keys)
    return data


def buffers(count: int, size: int = 256) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(count)]


def store_pattern(seed: int, fail_mode: str = "keys") -> list[bool]:
    adapter = open_fault(seed=seed, store_fail_rate=0.5, fail_mode=fail_mode)
    try:
        keys = make_keys(64)
        return BlockingAdapterClient(adapter).store(keys, [memoryview(b"x")] * 64)
    finally:
        adapter.close()


def test_the_seed_makes_faults_reproducible() -> None:
    first = store_pattern(seed=7)
    assert first == store_pattern(seed=7)
    assert first != store_pattern(seed=8)
    assert 0 < sum(first) < 64


def test_failed_stores_are_not_stored(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(store_fail_rate=1.0)
    opened.append(adapter)
    keys = make_keys(3)
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(b"abc")] * 3) == [False] * 3
    assert list(inner_of(adapter).list_keys()) == []
    assert adapter.stats()["injected_store_failures"] == 3


def test_failed_lookups_are_misses_and_pin_nothing(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(lookup_fail_rate=1.0)
    opened.append(adapter)
    keys = make_keys(2)
    fill(adapter, keys)
    assert BlockingAdapterClient(adapter).lookup_and_lock(keys).found == [False, False]
    assert adapter.pinned_keys() == {}
    assert adapter.delete(keys) == [True, True]


@pytest.mark.parametrize("fail_mode", ["keys", "batch"])
def test_failed_lookups_do_not_forget_what_is_stored(opened: list[BackendAdapter], fail_mode: str) -> None:
    """An injected lookup failure says nothing about whether the objects are there: they
    stay accounted (usage, eviction), not reported vanished."""
    adapter = open_fault(lookup_fail_rate=1.0, fail_mode=fail_mode)
    opened.append(adapter)
    client = BlockingAdapterClient(adapter)
    keys = make_keys(2)
    assert client.store(keys, [memoryview(b"s" * 100)] * 2) == [True, True]
    assert client.lookup_and_lock(keys).found == [False, False]
    assert adapter.pinned_keys() == {}
    assert adapter.used_bytes() == 200
    assert adapter.stats().get("objects_vanished", 0) == 0
    assert [key for key, _size in inner_of(adapter).list_keys()] == keys


def test_a_failed_delete_checked_by_a_failed_lookup_forgets_nothing(opened: list[BackendAdapter]) -> None:
    """A delete that failed is followed by a lookup of its keys; failed too, it must not
    release keys the inner adapter still holds."""
    adapter = open_fault(lookup_fail_rate=1.0, delete_fail_rate=1.0)
    opened.append(adapter)
    keys = make_keys(2)
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(b"d" * 100)] * 2) == [True, True]
    assert adapter.delete(keys) == [False, False]
    assert adapter.used_bytes() == 200
    assert adapter.stats().get("objects_vanished", 0) == 0
    assert len(list(inner_of(adapter).list_keys())) == 2


def test_a_failed_delete_of_keys_stored_by_others_announces_none_absent(opened: list[BackendAdapter]) -> None:
    """Keys stored behind the adapter (another server sharing the store) and listed for
    eviction are still there after a failed delete: never announced absent."""
    adapter = open_fault(lookup_fail_rate=1.0, delete_fail_rate=1.0)
    opened.append(adapter)
    keys = make_keys(2)
    fill(adapter, keys)
    assert adapter.delete(keys) == [False, False]
    stats = adapter.stats()
    assert (stats.get("delete_keys_absent", 0), stats.get("objects_vanished", 0)) == (0, 0)
    assert len(list(inner_of(adapter).list_keys())) == 2


def test_injected_faults_are_logged(opened: list[BackendAdapter], caplog: pytest.LogCaptureFixture) -> None:
    adapter = open_fault(store_fail_rate=1.0, corrupt_rate=1.0, corrupt_detected=False)
    opened.append(adapter)
    client = BlockingAdapterClient(adapter)
    with caplog.at_level(logging.WARNING):
        assert client.store(make_keys(1, start=9), [memoryview(b"f")]) == [False]
        keys = make_keys(1)
        fill(adapter, keys)
        client.lookup_and_lock(keys)
        assert client.load(keys, buffers(1)) == [True]
        adapter.unlock(keys)
    assert "injected store failure of 1/1 keys" in caplog.text
    assert "injected corruption" in caplog.text


def test_the_per_operation_rates_do_not_default_to_rate(opened: list[BackendAdapter]) -> None:
    """``rate`` is LMCache's: it fails loads of the keys it chooses, and is no default
    failure rate of stores or lookups."""
    adapter = open_fault(rate=1.0)
    opened.append(adapter)
    keys = make_keys(2)
    fill(adapter, keys)
    client = BlockingAdapterClient(adapter)
    assert client.store(make_keys(1, start=50), [memoryview(b"z")]) == [True]
    assert client.lookup_and_lock(keys).found == [True, True]
    targets = buffers(2)
    assert client.load(keys, targets) == [False, False]
    assert all(bytes(t) == bytes(256) for t in targets)
    adapter.unlock(keys)
    stats = adapter.stats()
    assert stats["injected_rate_failures"] == 2
    for op in ("store", "lookup", "load", "delete"):
        assert stats.get(f"injected_{op}_failures", 0) == 0, op


def test_failed_loads_leave_buffers_untouched_and_release_pins(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(load_fail_rate=1.0)
    opened.append(adapter)
    keys = make_keys(2)
    fill(adapter, keys)
    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock(keys).found == [True, True]
    targets = buffers(2)
    assert client.load(keys, targets) == [False, False]
    assert all(bytes(t) == bytes(256) for t in targets)
    adapter.unlock(keys)
    assert adapter.pinned_keys() == {}
    assert adapter.delete(keys) == [True, True]


def test_batch_mode_fails_whole_calls() -> None:
    adapter = open_fault(seed=3, store_fail_rate=0.5, fail_mode="batch")
    try:
        client = BlockingAdapterClient(adapter)
        outcomes = {tuple(client.store(make_keys(8, start=8 * i), [memoryview(b"b")] * 8)) for i in range(40)}
        assert outcomes == {(True,) * 8, (False,) * 8}
    finally:
        adapter.close()


def test_raise_mode_becomes_a_counted_backend_error(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(store_fail_rate=1.0, fail_mode="raise")
    opened.append(adapter)
    keys = make_keys(2)
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(b"r")] * 2) == [False, False]
    stats = adapter.stats()
    assert stats["backend_errors"] == 1
    assert stats["injected_store_failures"] == 2


@pytest.mark.parametrize(
    ("count", "indices", "ratios", "expected"),
    [
        (5, (), (0.5,), {2}),
        (5, (), (0.0,), {4}),
        (5, (), (1.0,), {0}),
        (4, (), (0.5,), {2}),
        (1, (), (0.5,), {0}),
        (6, (1, -1), (), {1, 5}),
        (3, (7, -9), (), set()),
        (0, (0,), (0.5,), set()),
    ],
)
def test_gap_positions(
    count: int, indices: tuple[int, ...], ratios: tuple[float, ...], expected: set[int]
) -> None:
    assert gap_positions(count, indices, ratios) == expected


def test_gaps_drop_positions_of_every_load(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(gap_tail_ratios=(0.5,), gap_indices=(0,))
    opened.append(adapter)
    keys = make_keys(5)
    data = fill(adapter, keys)
    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock(keys).found == [True] * 5, "gaps apply to loads, not lookups"
    targets = buffers(5)
    assert client.load(keys, targets) == [False, True, False, True, True]
    assert [bytes(targets[i]) for i in (1, 3, 4)] == [data[i] for i in (1, 3, 4)]
    adapter.unlock(keys)
    assert adapter.stats()["injected_load_gaps"] == 2


def test_detected_corruption_fails_the_load(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(corrupt_rate=1.0)
    opened.append(adapter)
    keys = make_keys(1)
    fill(adapter, keys)
    client = BlockingAdapterClient(adapter)
    client.lookup_and_lock(keys)
    assert client.load(keys, buffers(1)) == [False]
    adapter.unlock(keys)
    assert adapter.stats()["injected_corruptions"] == 1


def test_silent_corruption_hands_back_one_flipped_byte(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(corrupt_rate=1.0, corrupt_detected=False)
    opened.append(adapter)
    keys = make_keys(1)
    (data,) = fill(adapter, keys)
    client = BlockingAdapterClient(adapter)
    client.lookup_and_lock(keys)
    (target,) = buffers(1)
    assert client.load(keys, [target]) == [True]
    differing = [i for i, (a, b) in enumerate(zip(bytes(target), data, strict=True)) if a != b]
    assert len(differing) == 1
    adapter.unlock(keys)


class Signed:
    """Appends a digest and verifies it: an end-to-end check like an authenticating serde."""

    name = "signed"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(data) + blake3.blake3(data).digest()

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        body, digest = data[:-32], bytes(data[-32:])
        if blake3.blake3(body).digest() != digest:
            raise ValueError("digest mismatch")
        return body


def test_silent_corruption_is_caught_by_the_wrappers_serde(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(serde=(Signed(),), corrupt_rate=1.0, corrupt_detected=False)
    opened.append(adapter)
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter)
    assert client.store(keys, [memoryview(b"k" * 300)]) == [True]
    assert client.lookup_and_lock(keys).sizes == [300]
    assert client.load(keys, buffers(1, 300)) == [False]
    adapter.unlock(keys)
    assert adapter.stats()["serde_decode_failures"] == 1


def test_delays_are_counted_and_close_cuts_them_short() -> None:
    adapter = open_fault(delay_s=3600.0, delay_ops=("store",))
    task_id = adapter.submit_store(make_keys(1), [memoryview(b"d")])
    deadline = time.monotonic() + 60
    while adapter.stats().get("injected_store_delays", 0) == 0:
        assert time.monotonic() < deadline, "the store never started its delay"
        time.sleep(0.005)
    lookup = BlockingAdapterClient(adapter, timeout=60).lookup_and_lock(make_keys(1))
    assert lookup.found == [False], "lookups are not delayed"
    adapter.close()
    assert adapter.pop_completed_stores() == {task_id: [False]}
    assert adapter.stats()["injected_store_delays"] == 1


def test_a_stalled_inner_lookup_times_out_as_a_miss(opened: list[BackendAdapter]) -> None:
    stalled_inner = {"type": "fault_inject", "inner": mock_spec(), "delay_s": 3600, "delay_ops": ["lookup"]}
    adapter = open_fault(inner=stalled_inner, lookup_timeout_s=0.1)
    opened.append(adapter)
    assert BlockingAdapterClient(adapter).lookup_and_lock(make_keys(1)).found == [False]
    assert adapter.stats()["inner_lookup_timeouts"] == 1


def test_a_stalled_inner_lookup_does_not_forget_what_is_stored(opened: list[BackendAdapter]) -> None:
    """A lookup the inner adapter did not answer in time says nothing about whether the
    objects are there: they stay accounted (usage, eviction), not reported vanished."""
    stalled_inner = {"type": "fault_inject", "inner": mock_spec(), "delay_s": 3600, "delay_ops": ["lookup"]}
    adapter = open_fault(inner=stalled_inner, lookup_timeout_s=0.1)
    opened.append(adapter)
    client = BlockingAdapterClient(adapter)
    keys = make_keys(2)
    assert client.store(keys, [memoryview(b"s" * 100)] * 2) == [True, True]
    assert client.lookup_and_lock(keys).found == [False, False]
    assert adapter.stats()["inner_lookup_timeouts"] == 1
    assert adapter.used_bytes() == 200
    assert adapter.stats().get("objects_vanished", 0) == 0
    assert [key for key, _size in inner_of(adapter).inner.list_keys()] == keys


STUCK_LOOKUP_SCRIPT = """
import threading, types
from lmcache_plugin_fault_inject import FaultInjectConfig
from lmcache_plugin_fault_inject.backend import open_fault_inject
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.l2 import AdapterContext, create_adapter
from lmcache_tiers.plugin import L2AdapterConfig
from lmcache_tiers.plugins import discover
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

class Stuck:
    def __init__(self, config, context):
        self.never = threading.Event()
    def put_many(self, keys, payloads):
        return [True] * len(keys)
    def contains_many(self, keys):
        self.never.wait()
    def get_many_into(self, keys, buffers):
        return [False] * len(keys)
    def delete_many(self, keys):
        return [False] * len(keys)
    def list_keys(self):
        return []
    def capacity(self):
        return None

class StuckConfig(L2AdapterConfig):
    \"\"\"A backend whose lookups never return.\"\"\"

@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("stuck", Stuck, StuckConfig)

module = types.ModuleType("stuck_lookup_test")
module.tiers_register_l2_adapters = tiers_register_l2_adapters
registry = discover(extra_plugins={"stuck-lookup-test": module}).registry
config = FaultInjectConfig(inner={"type": "stuck"}, lookup_timeout_s=0.1)
context = AdapterContext(index=0, name="0:fault_inject", config=config)
adapter = create_adapter(open_fault_inject, config, context, registry=registry)
assert BlockingAdapterClient(adapter).lookup_and_lock(make_keys(1)).found == [False]
adapter.close()
"""


def test_a_lookup_stuck_in_the_inner_adapter_does_not_keep_the_process_from_exiting() -> None:
    """The thread of an abandoned inner lookup must not be joined at interpreter exit."""
    done = subprocess.run([sys.executable, "-c", STUCK_LOOKUP_SCRIPT], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()


#: lets the lookups of :class:`HeldLookups` go
_lookups_held = threading.Event()


class HeldLookups(MockBackend):
    """The mock whose lookups wait until the test lets them go."""

    def contains_many(self, keys: Sequence[ObjectKey]) -> Any:
        _lookups_held.wait(60)
        return super().contains_many(keys)


@hookimpl(specname="tiers_register_l2_adapters")
def register_held_lookups(registry: KindRegistry) -> None:
    registry.add("held_lookups", HeldLookups, MockConfig)


def test_the_thread_left_in_an_inner_lookup_is_named_for_its_adapter(opened: list[BackendAdapter]) -> None:
    """An operator reading a thread dump must tell the thread an abandoned lookup left
    behind from the adapter's own workers, and see whose adapter it is: under the
    ``l2-<adapter>-`` prefix every other thread of an adapter has."""
    module = types.ModuleType("fault_inject_held_test")
    module.tiers_register_l2_adapters = register_held_lookups  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-held-test": module}).registry
    config = FaultInjectConfig(
        inner={"type": "held_lookups", "namespace": uuid.uuid4().hex}, lookup_timeout_s=0.1
    )
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    before = set(threading.enumerate())
    _lookups_held.clear()
    try:
        adapter = create_adapter(open_fault_inject, config, context, registry=registry)
        opened.append(adapter)
        assert BlockingAdapterClient(adapter).lookup_and_lock(make_keys(1)).found == [False]
        left = [thread.name for thread in threading.enumerate() if thread not in before]
    finally:
        _lookups_held.set()
    assert "l2-0:fault_inject-inner-lookup_1" in left, left


class RemoteMock(MockBackend):
    """The mock, declared remote as a network store is."""

    remote = True


@hookimpl(specname="tiers_register_l2_adapters")
def register_remote_mock(registry: KindRegistry) -> None:
    registry.add("remote_mock", RemoteMock, MockConfig)


def test_a_remote_inner_adapter_keeps_its_circuit_breaker(
    opened: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    module = types.ModuleType("fault_inject_remote_test")
    module.tiers_register_l2_adapters = register_remote_mock  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-remote-test": module}).registry
    inner = {"type": "remote_mock", "namespace": uuid.uuid4().hex, "circuit": {"call_timeout_s": 1.0}}
    config = FaultInjectConfig(inner=inner)
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    with caplog.at_level(logging.WARNING):
        adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    opened.append(adapter)
    assert "circuit breaker of the inner adapter never runs" in caplog.text
    assert "circuit_open" in adapter.stats(), "a remote store is guarded, wrapped or not"


class MixedMock(MockBackend):
    """A broken backend: a coroutine ``put_many`` beside plain lookups, loads and deletes."""

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        return super().put_many(keys, payloads)


@hookimpl(specname="tiers_register_l2_adapters")
def register_mixed_mock(registry: KindRegistry) -> None:
    registry.add("mixed_mock", MixedMock, MockConfig)


def test_an_inner_backend_mixing_coroutines_and_plain_methods_is_refused_at_start() -> None:
    """Core refuses such a backend when it builds it; wrapped, it must be refused the same
    way, not wrapped in the flavour of its ``put_many`` and fail every other call; the
    refusal names the adapter and the backend."""
    module = types.ModuleType("fault_inject_mixed_test")
    module.tiers_register_l2_adapters = register_mixed_mock  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-mixed-test": module}).registry
    config = FaultInjectConfig(inner={"type": "mixed_mock"})
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    with pytest.raises(PluginError, match=r"0:fault_inject.*MixedMock mixes coroutine and plain"):
        create_adapter(open_fault_inject, config, context, registry=registry)


def test_one_accounting_with_the_inner_capacity(opened: list[BackendAdapter]) -> None:
    adapter = open_fault(inner=mock_spec(max_size_gb=1 / 1024))
    opened.append(adapter)
    keys = make_keys(2, salt="t")
    BlockingAdapterClient(adapter).store(keys, [memoryview(b"x" * 512)] * 2)
    assert adapter.used_bytes() == 1024
    assert adapter.used_bytes_by_salt() == {"t": 1024}
    assert adapter.usage() == pytest.approx(1024 / (1 << 20))


def test_config_is_decoded_with_its_inner_spec() -> None:
    raw = {"type": "fault_inject", "inner": {"type": "mock"}, "rate": 0.25, "gap_tail_ratios": [0.5]}
    spec = decode_adapter(load_registry(), raw, 0)
    assert isinstance(spec.config, FaultInjectConfig)
    assert spec.config.gap_tail_ratios == (0.5,)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"inner": {"max_size_gb": 1}}, 'string "type"'),
        ({"inner": {"type": "mock"}, "rate": 1.5}, "rate"),
        ({"inner": {"type": "mock"}, "load_fail_rate": None}, "load_fail_rate"),
        ({"inner": {"type": "mock"}, "delay_ops": ["sotre"]}, "delay_ops"),
        ({"inner": {"type": "mock"}, "gap_tail_ratios": [2.0]}, "gap_tail_ratios"),
        ({"inner": {"type": "mock"}, "fail_mode": "explode"}, "fail_mode"),
    ],
)
def test_bad_config_is_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_adapter(load_registry(), {"type": "fault_inject", **raw}, 0)


@pytest.mark.parametrize(
    ("inner", "message"),
    [
        (
            {"type": "mokc"},
            r"^unknown l2 adapter 'mokc': did you mean 'mock'\?.* - at `\$\.l2_adapters\[3\]\.inner\.type`$",
        ),
        ({"type": "mock", "max_size_gb": -1}, r"^mock: .* - at `\$\.l2_adapters\[3\]\.inner\.max_size_gb`$"),
        (
            {"type": "mock", "max_size_gb": float("inf")},
            r"^mock: Expected a finite number, got inf - at `\$\.l2_adapters\[3\]\.inner\.max_size_gb`$",
        ),
        (
            {"type": "fault_inject", "inner": {"type": "mock", "bandwidth_bytes_per_s": -1}},
            r"^mock: .* - at `\$\.l2_adapters\[3\]\.inner\.inner\.bandwidth_bytes_per_s`$",
        ),
        (
            {"max_size_gb": 1},
            r"^fault_inject: `inner` must be an adapter spec .* - at `\$\.l2_adapters\[3\]\.inner`$",
        ),
    ],
)
def test_a_bad_inner_spec_is_refused_with_the_config_naming_its_path(
    inner: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_adapter(load_registry(), {"type": "fault_inject", "inner": inner}, 3)


@pytest.mark.parametrize(
    ("inner", "message"),
    [({"type": "mokc"}, "did you mean 'mock'"), ({"type": "mock", "max_size_gb": -1}, "max_size_gb")],
)
def test_bad_inner_spec_is_a_config_error_naming_inner(inner: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"inner.*{message}"):
        open_fault(inner=inner)


def test_the_inner_backend_runs_inside_the_wrapper(opened: list[BackendAdapter]) -> None:
    nested = {"type": "fault_inject", "inner": mock_spec(), "lookup_fail_rate": 1.0}
    adapter = open_fault(inner=nested)
    opened.append(adapter)
    inner = inner_of(adapter)
    assert not isinstance(inner, L2Adapter), "one task board, one pin table, one accounting"
    keys = make_keys(1)
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(b"s")]) == [True]
    assert adapter.used_bytes() == 1
    assert BlockingAdapterClient(adapter).lookup_and_lock(keys).found == [False]
    stats = adapter.stats()
    assert stats["inner_injected_lookup_failures"] == 1, "the inner backend's counters, prefixed"
    assert stats.get("injected_lookup_failures", 0) == 0


class AsyncMemory:
    """A coroutine backend, to show the wrapper turns into coroutines around one."""

    def __init__(self, config: Any, context: Any) -> None:
        self.objects: dict[ObjectKey, bytes] = {}
        self.stall = asyncio.Event()
        self.stall.set()

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self.objects.update((key, bytes(payload)) for key, payload in zip(keys, payloads, strict=True))
        return [True] * len(keys)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        await self.stall.wait()
        return [len(self.objects[key]) if key in self.objects else None for key in keys]

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = []
        for key, buffer in zip(keys, buffers, strict=True):
            data = self.objects.get(key)
            if data is not None and len(data) == buffer.nbytes:
                buffer[:] = data
            ok.append(data is not None and len(data) == buffer.nbytes)
        return ok

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return [self.objects.pop(key, None) is not None for key in keys]

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:
        for key, data in list(self.objects.items()):
            yield key, len(data)

    def capacity(self) -> None:
        return None


class AsyncMemoryConfig(L2AdapterConfig):
    """A coroutine backend for the fault_inject tests."""


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("async_memory", AsyncMemory, AsyncMemoryConfig)


def test_a_coroutine_backend_is_wrapped_in_coroutines(opened: list[BackendAdapter]) -> None:
    module = types.ModuleType("fault_inject_async_test")
    module.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-async-test": module}).registry
    config = FaultInjectConfig(inner={"type": "async_memory"}, load_fail_rate=1.0, lookup_timeout_s=0.1)
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    assert isinstance(adapter, BackendAdapter)
    opened.append(adapter)
    assert inspect.iscoroutinefunction(adapter.backend.put_many)  # type: ignore[attr-defined]
    client = BlockingAdapterClient(adapter)
    keys = make_keys(2)
    assert client.store(keys, [memoryview(b"a"), memoryview(b"b")]) == [True, True]
    assert client.lookup_and_lock(keys).found == [True, True]
    assert client.load(keys, buffers(2, 1)) == [False, False]
    adapter.unlock(keys)
    inner_of(adapter).stall.clear()  # the next lookup stalls in the inner backend
    assert client.lookup_and_lock(keys).found == [False, False]
    stats = adapter.stats()
    assert (stats["injected_load_failures"], stats["inner_lookup_timeouts"]) == (2, 1)
    # A lookup that timed out says nothing about the objects: they stay accounted.
    assert (adapter.used_bytes(), stats.get("objects_vanished", 0)) == (2, 0)
    assert adapter.delete(keys) == [True, True]


def test_failed_coroutine_lookups_do_not_forget_what_is_stored(opened: list[BackendAdapter]) -> None:
    adapter = open_async_fault(lookup_fail_rate=1.0)
    opened.append(adapter)
    client = BlockingAdapterClient(adapter)
    keys = make_keys(2)
    assert client.store(keys, [memoryview(b"a" * 10)] * 2) == [True, True]
    assert client.lookup_and_lock(keys).found == [False, False]
    assert (adapter.used_bytes(), adapter.stats().get("objects_vanished", 0)) == (20, 0)
    assert list(inner_of(adapter).objects) == keys


def open_async_fault(**settings: Any) -> BackendAdapter:
    """fault_inject around the coroutine backend above."""
    module = types.ModuleType("fault_inject_async_test")
    module.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-async-test": module}).registry
    config = FaultInjectConfig(inner={"type": "async_memory"}, **settings)
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def store_outcomes(*, overlapping: bool) -> list[list[bool]]:
    """Outcomes of 12 one-key stores, some delayed, submitted at once or one at a time."""
    adapter = open_async_fault(seed=5, store_fail_rate=0.5, delay_s=0.1, delay_rate=0.5, delay_ops=("store",))
    try:
        client = BlockingAdapterClient(adapter)
        calls = [(make_keys(1, start=i), [memoryview(b"o")]) for i in range(12)]
        if not overlapping:
            return [client.store(keys, payloads) for keys, payloads in calls]
        task_ids = [adapter.submit_store(keys, payloads) for keys, payloads in calls]
        return [client.wait(L2Op.STORE, task_id) for task_id in task_ids]
    finally:
        adapter.close()


def test_faults_follow_the_order_of_calls_not_the_end_of_their_delays() -> None:
    # Overlapping calls on the event loop: an undelayed call finishes before delayed ones
    # started earlier, and must still get the faults of its place in the sequence.
    one_at_a_time = store_outcomes(overlapping=False)
    assert [True] in one_at_a_time and [False] in one_at_a_time
    assert store_outcomes(overlapping=True) == one_at_a_time


def load_outcomes(*, overlapping: bool) -> list[list[bool]]:
    """Outcomes of 12 one-key loads, some delayed, some failed, some corrupted (reported as
    failed), submitted at once or one at a time."""
    adapter = open_async_fault(
        seed=3, load_fail_rate=0.3, corrupt_rate=0.5, delay_s=0.1, delay_rate=0.5, delay_ops=("load",)
    )
    try:
        client = BlockingAdapterClient(adapter)
        keys = make_keys(12)
        assert client.store(keys, [memoryview(pattern(i, 64)) for i in range(12)]) == [True] * 12
        assert client.lookup_and_lock(keys).found == [True] * 12
        calls = [([key], buffers(1, 64)) for key in keys]
        if not overlapping:
            outcomes = [client.load(one, targets) for one, targets in calls]
        else:
            task_ids = [adapter.submit_load(one, targets) for one, targets in calls]
            outcomes = [client.wait(L2Op.LOAD, task_id) for task_id in task_ids]
        adapter.unlock(keys)
        assert adapter.stats()["injected_corruptions"] > 0
        return outcomes
    finally:
        adapter.close()


def test_corruptions_follow_the_order_of_calls_not_the_end_of_their_loads() -> None:
    # Which load is corrupted is drawn with its failures when it starts: drawn once the
    # inner load is done, overlapping loads would take each other's corruptions.
    one_at_a_time = load_outcomes(overlapping=False)
    assert [True] in one_at_a_time and [False] in one_at_a_time
    assert load_outcomes(overlapping=True) == one_at_a_time


@pytest.mark.parametrize("rate", [0.1, 0.75])
def test_the_failure_rate_is_the_fraction_of_keys_that_fail(rate: float) -> None:
    adapter = open_fault(seed=11, store_fail_rate=rate)
    try:
        outcomes = BlockingAdapterClient(adapter).store(make_keys(2000), [memoryview(b"p")] * 2000)
    finally:
        adapter.close()
    assert abs(outcomes.count(False) / 2000 - rate) < 0.04


class CountingMock(MockBackend):
    """The mock, answering a load with the count of bytes it read -- half the object, a
    short read -- where the contract asks for a boolean."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[Any]:
        halves = [buffer[: buffer.nbytes // 2] for buffer in buffers]
        whole = [memoryview(bytearray(buffer.nbytes)) for buffer in buffers]
        super().get_many_into(keys, whole)
        for half, data in zip(halves, whole, strict=True):
            half[:] = data[: half.nbytes]
        return [half.nbytes for half in halves]


@hookimpl(specname="tiers_register_l2_adapters")
def register_counting_mock(registry: KindRegistry) -> None:
    registry.add("counting_mock", CountingMock, MockConfig)


def test_an_inner_load_answer_that_is_not_a_boolean_is_not_turned_into_success(
    opened: list[BackendAdapter],
) -> None:
    """Core refuses a load answered with anything but booleans (a byte count passes for
    success even when the read was short); wrapped, the inner answer must reach it as it is."""
    module = types.ModuleType("fault_inject_counting_test")
    module.tiers_register_l2_adapters = register_counting_mock  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-counting-test": module}).registry
    config = FaultInjectConfig(inner={"type": "counting_mock", "namespace": uuid.uuid4().hex})
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    assert isinstance(adapter, BackendAdapter)
    opened.append(adapter)
    keys = make_keys(2)
    fill(adapter, keys)
    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock(keys).found == [True, True]
    assert client.load(keys, buffers(2)) == [False, False], "half-read objects handed out as loaded"
    adapter.unlock(keys)


class HalfMock(MockBackend):
    """The mock as a store of two nodes, one of which does not answer: stores and deletes
    do the first half of the keys they get and raise ``PartialFailure`` for the rest."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        half = len(keys) // 2
        done = super().put_many(keys[:half], payloads[:half])
        raise PartialFailure([*done, *[False] * (len(keys) - half)], "node 2 did not answer")

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        half = len(keys) // 2
        done = super().delete_many(keys[:half])
        raise PartialFailure([*done, *[False] * (len(keys) - half)], "node 2 did not answer")


@hookimpl(specname="tiers_register_l2_adapters")
def register_half_mock(registry: KindRegistry) -> None:
    registry.add("half_mock", HalfMock, MockConfig)


def test_an_inner_call_that_failed_part_way_reports_the_keys_it_did(opened: list[BackendAdapter]) -> None:
    """The inner backend gets only the keys no fault was injected into; the per-key answer
    of its ``PartialFailure`` is about those keys, and must reach core for the whole batch:
    misaligned, core fails every key -- objects the inner backend stored would be in no
    accounting (usage, eviction), and objects it removed would be reported still there."""
    module = types.ModuleType("fault_inject_half_test")
    module.tiers_register_l2_adapters = register_half_mock  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-half-test": module}).registry
    config = FaultInjectConfig(
        inner={"type": "half_mock", "namespace": uuid.uuid4().hex}, seed=3, store_fail_rate=0.25
    )
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    assert isinstance(adapter, BackendAdapter)
    opened.append(adapter)
    keys = make_keys(8)
    stored = BlockingAdapterClient(adapter).store(keys, [memoryview(b"x" * 100)] * 8)
    held = dict(inner_of(adapter).list_keys())
    assert held and adapter.stats()["injected_store_failures"] > 0
    assert stored == [key in held for key in keys]
    assert adapter.used_bytes() == sum(held.values()), "every stored object is accounted"

    deleted = adapter.delete(keys)
    assert any(deleted)
    assert deleted == [key in held and key not in dict(inner_of(adapter).list_keys()) for key in keys]
    assert adapter.used_bytes() == sum(dict(inner_of(adapter).list_keys()).values())


class StalledLookupMock(MockBackend):
    """The mock, whose lookups wait at ``gate`` (closed at first) and are counted."""

    def __init__(self, config: MockConfig, context: Any) -> None:
        super().__init__(config, context)
        self.gate = threading.Event()
        self.lookups = 0
        self._count_lock = threading.Lock()

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        with self._count_lock:
            self.lookups += 1
        self.gate.wait()
        return super().contains_many(keys)


@hookimpl(specname="tiers_register_l2_adapters")
def register_stalled_lookup_mock(registry: KindRegistry) -> None:
    registry.add("stalled_lookup_mock", StalledLookupMock, MockConfig)


def test_lookups_given_up_on_are_not_asked_of_the_inner_adapter_later(opened: list[BackendAdapter]) -> None:
    """A lookup that timed out while waiting for a helper thread (all of them stuck in the
    inner adapter) must not stay queued: abandoned lookups would pile up for as long as
    the inner adapter is stuck, and once it answers again, every one of them would be
    asked of it before any new lookup."""
    module = types.ModuleType("fault_inject_stalled_lookup_test")
    module.tiers_register_l2_adapters = register_stalled_lookup_mock  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-stalled-lookup-test": module}).registry
    config = FaultInjectConfig(
        inner={"type": "stalled_lookup_mock", "namespace": uuid.uuid4().hex}, lookup_timeout_s=0.05
    )
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    assert isinstance(adapter, BackendAdapter)
    opened.append(adapter)
    wrapper, inner = adapter.backend, inner_of(adapter)
    helpers = wrapper._lookups  # type: ignore[attr-defined]
    keys = make_keys(1)
    try:
        for _ in range(helpers.limit + 3):  # the first ones hold every helper thread
            with pytest.raises(InnerLookupTimeout):
                wrapper.contains_many(keys)  # type: ignore[attr-defined]
    finally:
        inner.gate.set()
    # Once every helper thread reaches the barrier, everything queued before it has run.
    barrier = threading.Barrier(helpers.limit + 1)
    for _ in range(helpers.limit):
        helpers.submit(lambda: barrier.wait(10))
    barrier.wait(10)
    # (At most one stuck lookup per helper thread; none of those queued behind them.)
    assert inner.lookups <= helpers.limit, "lookups given up on were asked of the inner adapter"


# -- the circuit breaker's probe: the inner adapter's ping ------------------------------------


class PingingRemoteMock(MockBackend):
    """A remote store with a ping of its own (a redis cluster pings every primary)."""

    remote = True

    def __init__(self, config: MockConfig, context: Any) -> None:
        super().__init__(config, context)
        self.pings = 0

    def ping(self) -> None:
        self.pings += 1


class AsyncPingingMemory(AsyncMemory):
    """The coroutine backend, with a ping."""

    def __init__(self, config: Any, context: Any) -> None:
        super().__init__(config, context)
        self.pings = 0

    async def ping(self) -> None:
        self.pings += 1


@hookimpl(specname="tiers_register_l2_adapters")
def register_pinging_backends(registry: KindRegistry) -> None:
    registry.add("pinging_remote_mock", PingingRemoteMock, MockConfig)
    registry.add("async_pinging_memory", AsyncPingingMemory, AsyncMemoryConfig)


def open_pinging(inner: dict[str, Any], **settings: Any) -> BackendAdapter:
    module = types.ModuleType("fault_inject_pinging_test")
    module.tiers_register_l2_adapters = register_pinging_backends  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-pinging-test": module}).registry
    config = FaultInjectConfig(inner=inner, **settings)
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def test_the_circuit_probe_reaches_the_inner_adapters_ping(opened: list[BackendAdapter]) -> None:
    # Stores raise (a backend error each): the circuit opens at the first, and its probe
    # must be the inner store's own ping, not a lookup of one key.
    adapter = open_pinging(
        {"type": "pinging_remote_mock", "namespace": uuid.uuid4().hex},
        store_fail_rate=1.0,
        fail_mode="raise",
        circuit=CircuitConfig(failure_threshold=1, probe_interval_s=0.02),
    )
    opened.append(adapter)
    inner = adapter.backend.inner.inner  # type: ignore[attr-defined]
    assert BlockingAdapterClient(adapter).store(make_keys(1), [memoryview(b"x")]) == [False]
    deadline = time.monotonic() + 30
    while adapter.stats()["circuit_open"]:
        assert time.monotonic() < deadline, "the circuit never closed"
        time.sleep(0.01)
    assert inner.pings >= 1, "the probe asked a lookup of the wrapper, not the inner ping"


def ping_outcome(wrapper: Any) -> OSError | None:
    """What the wrapper's ping raised (None: it answered), whichever its flavour."""

    async def ping_coroutine() -> None:
        await wrapper.ping()

    try:
        if inspect.iscoroutinefunction(wrapper.ping):
            asyncio.run(ping_coroutine())
        else:
            wrapper.ping()
    except OSError as exc:
        return exc
    return None


@pytest.mark.parametrize(
    "inner",
    [{"type": "pinging_remote_mock"}, {"type": "async_pinging_memory"}],
    ids=["plain", "coroutines"],
)
@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_a_ping_is_passed_on_or_fails_with_the_lookup_failure_rate(
    opened: list[BackendAdapter], inner: dict[str, Any], rate: float
) -> None:
    if inner["type"] == "pinging_remote_mock":
        inner = {**inner, "namespace": uuid.uuid4().hex}
    adapter = open_pinging(inner, lookup_fail_rate=rate, circuit=CircuitConfig(enabled=False))
    opened.append(adapter)
    failure = ping_outcome(adapter.backend)
    if rate:
        assert isinstance(failure, OSError), "an injected ping failure must raise"
        assert inner_of(adapter).pings == 0
        assert adapter.stats()["injected_lookup_failures"] == 1
    else:
        assert failure is None
        assert inner_of(adapter).pings == 1, "the inner adapter's ping was not passed on"


def test_without_an_inner_ping_the_wrappers_ping_is_a_lookup_of_the_probe_key(
    opened: list[BackendAdapter],
) -> None:
    adapter = open_fault(lookup_fail_rate=1.0)
    opened.append(adapter)
    fill(adapter, [PROBE_KEY])  # held by the inner store: a failed lookup of it raises
    with pytest.raises(OSError, match="injected lookup failure"):
        adapter.backend.ping()  # type: ignore[attr-defined]
    assert adapter.stats()["injected_lookup_failures"] == 1


def test_a_gap_on_a_key_already_failed_is_counted_once_and_gaps_are_logged(
    opened: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    """Each key a load loses to the wrapper is one injected fault: a gap position whose key
    the failure rate already took is not counted again, and a gap says so in the log."""
    adapter = open_fault(load_fail_rate=1.0, gap_indices=(0,))
    opened.append(adapter)
    keys = make_keys(2)
    fill(adapter, keys)
    client = BlockingAdapterClient(adapter)
    client.lookup_and_lock(keys)
    assert client.load(keys, buffers(2)) == [False, False]
    adapter.unlock(keys)
    stats = adapter.stats()
    assert (stats["injected_load_failures"], stats.get("injected_load_gaps", 0)) == (2, 0)

    gapped = open_fault(gap_indices=(0,))
    opened.append(gapped)
    fill(gapped, keys)
    client = BlockingAdapterClient(gapped)
    client.lookup_and_lock(keys)
    with caplog.at_level(logging.WARNING):
        assert client.load(keys, buffers(2)) == [False, True]
    gapped.unlock(keys)
    assert gapped.stats()["injected_load_gaps"] == 1
    assert "injected load gap of 1/2 keys" in caplog.text
