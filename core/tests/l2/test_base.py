"""The adapter base classes: the conformance suite on small dict backends (sync and async,
with and without record headers and serdes), then the failure paths the suite cannot reach
through a well-behaved backend."""

from __future__ import annotations

import asyncio
import threading
import types
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

import lmcache_tiers.testing.base as testing_base
from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import (
    AdapterContext,
    AsyncBatchL2Adapter,
    BatchL2Adapter,
    BlockingAdapterClient,
    L2Op,
    ObjectSize,
)
from lmcache_tiers.l2.record import RecordError, decode_record
from lmcache_tiers.plugins import PluginSet, discover
from lmcache_tiers.registry import KindRegistry
from lmcache_tiers.serde import Serde, SerdeContext
from lmcache_tiers.testing.l2 import CAPACITY, EVICTION, PERSISTENCE, L2AdapterSuite, make_keys

# -- test backends ---------------------------------------------------------------------------


class DictConfig(L2AdapterConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Objects in a process-wide dict (shared per namespace), optionally as records."""

    namespace: str = ""
    capacity: int | None = None
    # store header + payload and verify both on every read, as a persistent adapter does
    records: bool = False


_SPACES: dict[str, dict[ObjectKey, bytes]] = {}


class DictBackend:
    """The plain batch I/O both test adapters share (one lock, one dict)."""

    def __init__(self, adapter: Any, config: DictConfig) -> None:
        self.adapter = adapter
        self.config = config
        self.lock = threading.Lock()
        self.objects = _SPACES.setdefault(config.namespace or uuid.uuid4().hex, {})

    def _payload_len(self, key: ObjectKey, value: bytes) -> int:
        return self.adapter.read_record_header(value, key).payload_len if self.config.records else len(value)

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        ok = []
        with self.lock:
            for key, payload in zip(keys, payloads, strict=True):
                used = sum(self._payload_len(k, v) for k, v in self.objects.items() if k != key)
                if self.config.capacity is not None and used + payload.nbytes > self.config.capacity:
                    ok.append(False)
                    continue
                header = self.adapter.record_header(key, payload) if self.config.records else b""
                self.objects[key] = header + bytes(payload)
                ok.append(True)
        return ok

    def _drop_corrupt(self, key: ObjectKey, exc: RecordError) -> None:
        self.objects.pop(key, None)
        self.adapter.count("corrupt_records")

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        found: list[int | ObjectSize | None] = []
        with self.lock:
            for key in keys:
                value = self.objects.get(key)
                if value is None or not self.config.records:
                    found.append(None if value is None else len(value))
                    continue
                try:
                    header = self.adapter.read_record_header(value, key)
                except RecordError as exc:
                    self._drop_corrupt(key, exc)
                    found.append(None)
                    continue
                found.append(ObjectSize(header.payload_len, header.l1_size))
        return found

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = []
        with self.lock:
            for key, buffer in zip(keys, buffers, strict=True):
                value = self.objects.get(key)
                if value is not None and self.config.records:
                    try:
                        _, payload = decode_record(value, expected_key=key)
                        value = bytes(payload)
                    except RecordError as exc:
                        self._drop_corrupt(key, exc)
                        value = None
                if value is None or len(value) != buffer.nbytes:
                    ok.append(False)
                    continue
                buffer[:] = value
                ok.append(True)
        return ok

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self.lock:
            return [self.objects.pop(key, None) is not None for key in keys]

    def list_keys(self) -> list[ObjectKey]:
        with self.lock:
            return list(self.objects)


class DictAdapter(BatchL2Adapter):
    def __init__(self, config: DictConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self.backend = DictBackend(self, config)
        self.capacity = config.capacity

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        return self.backend.put_many(keys, payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        return self.backend.contains_many(keys)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        return self.backend.get_many_into(keys, buffers)

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return self.backend.delete_many(keys)

    def iter_keys(self) -> Iterator[ObjectKey]:
        return iter(self.backend.list_keys())

    def capacity_bytes(self) -> int | None:
        return self.capacity


class AsyncDictAdapter(AsyncBatchL2Adapter):
    def __init__(self, config: DictConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self.backend = DictBackend(self, config)
        self.capacity = config.capacity
        self.opened = 0
        self.closed_backend = 0

    async def open_backend(self) -> None:
        self.opened += 1

    async def close_backend(self) -> None:
        self.closed_backend += 1

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        await asyncio.sleep(0)
        return self.backend.put_many(keys, payloads)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        await asyncio.sleep(0)
        return self.backend.contains_many(keys)

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        await asyncio.sleep(0)
        return self.backend.get_many_into(keys, buffers)

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        await asyncio.sleep(0)
        return self.backend.delete_many(keys)

    async def aiter_keys(self) -> AsyncIterator[ObjectKey]:
        for key in self.backend.list_keys():
            await asyncio.sleep(0)
            yield key

    def capacity_bytes(self) -> int | None:
        return self.capacity


class Xor:
    """Size-preserving transform: proves the chain runs without changing any size."""

    name = "xor"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(b ^ 0x5A for b in data)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(b ^ 0x5A for b in data)


class Zlib:
    name = "zlib"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return zlib.compress(data, 1)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return zlib.decompress(data)


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("test_dict", DictAdapter, DictConfig)
    registry.add("test_async_dict", AsyncDictAdapter, DictConfig)


_plugin_set: PluginSet | None = None


def plugins_with_test_adapters() -> PluginSet:
    """The installed plugins plus this module's test adapters, discovered once."""
    global _plugin_set
    if _plugin_set is None:
        module = types.ModuleType("lmcache_tiers_test_dict_adapters")
        module.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
        _plugin_set = discover(extra_plugins={"test-dict-adapters": module})
    return _plugin_set


# -- the conformance suite on every flavour ----------------------------------------------------


class _DictSuite(L2AdapterSuite):
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})
    records = False
    serde: tuple[Serde, ...] = ()

    @pytest.fixture(autouse=True)
    def _test_plugins(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(testing_base, "load_plugins", plugins_with_test_adapters)

    def make_config(self) -> DictConfig:
        return DictConfig(namespace=uuid.uuid4().hex, capacity=256 << 10, records=self.records)

    def make_context(self, config: L2AdapterConfig, l1_buffer: memoryview) -> AdapterContext:
        return AdapterContext(
            index=0, name=f"0:{self.component_name}", config=config, serde=self.serde, l1_buffer=l1_buffer
        )


class TestSyncBase(_DictSuite):
    component_name = "test_dict"


class TestAsyncBase(_DictSuite):
    component_name = "test_async_dict"


class TestSyncBaseWithRecordsAndSerde(_DictSuite):
    component_name = "test_dict"
    records = True
    serde = (Xor(),)


class TestAsyncBaseWithRecordsAndSerde(_DictSuite):
    component_name = "test_async_dict"
    records = True
    serde = (Xor(),)


# -- serde and records beyond the suite ---------------------------------------------------------


def open_dict(
    adapter_type: type[BatchL2Adapter] | type[AsyncBatchL2Adapter] = DictAdapter,
    *,
    serde: Sequence[Serde] = (),
    **config: Any,
) -> Any:
    settings = DictConfig(**config)
    return adapter_type(settings, AdapterContext(index=0, name="0:t", config=settings, serde=tuple(serde)))


@pytest.fixture
def adapters() -> Iterator[list[Any]]:
    opened: list[Any] = []
    yield opened
    for adapter in opened:
        adapter.close()


COMPRESSIBLE = b"kv-cache " * 2000


@pytest.mark.parametrize("adapter_type", [DictAdapter, AsyncDictAdapter])
def test_size_changing_serde_reports_l1_sizes_and_accounts_stored_bytes(
    adapter_type: type[Any], adapters: list[Any]
) -> None:
    adapter = open_dict(adapter_type, serde=[Zlib()])
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    assert client.store(keys, [memoryview(COMPRESSIBLE)]) == [True]
    assert client.lookup_and_lock(keys).sizes == [len(COMPRESSIBLE)]
    assert 0 < adapter.used_bytes() < len(COMPRESSIBLE) // 10
    buffer = memoryview(bytearray(len(COMPRESSIBLE)))
    assert client.load(keys, [buffer]) == [True]
    assert bytes(buffer) == COMPRESSIBLE
    adapter.unlock(keys)


def test_records_recover_l1_sizes_after_a_restart(adapters: list[Any]) -> None:
    namespace = uuid.uuid4().hex
    first = open_dict(serde=[Zlib()], namespace=namespace, records=True)
    keys = make_keys(1)
    assert BlockingAdapterClient(first).store(keys, [memoryview(COMPRESSIBLE)]) == [True]
    stored = first.used_bytes()
    first.close()
    second = open_dict(serde=[Zlib()], namespace=namespace, records=True)
    adapters.append(second)
    client = BlockingAdapterClient(second)
    assert second.used_bytes() == 0
    assert client.lookup_and_lock(keys).sizes == [len(COMPRESSIBLE)]
    assert second.used_bytes() == stored, "bytes are accounted lazily on the first hit"
    buffer = memoryview(bytearray(len(COMPRESSIBLE)))
    assert client.load(keys, [buffer]) == [True] and bytes(buffer) == COMPRESSIBLE
    second.unlock(keys)


def test_without_records_an_unknown_l1_size_is_a_miss(adapters: list[Any]) -> None:
    namespace = uuid.uuid4().hex
    first = open_dict(serde=[Zlib()], namespace=namespace)
    keys = make_keys(1)
    BlockingAdapterClient(first).store(keys, [memoryview(COMPRESSIBLE)])
    first.close()
    second = open_dict(serde=[Zlib()], namespace=namespace)
    adapters.append(second)
    assert BlockingAdapterClient(second).lookup_and_lock(keys).found == [False]
    assert second.stats()["lookup_size_unknown"] == 1
    assert second.pinned_keys() == {}


def test_a_record_of_another_serde_chain_is_a_miss_and_removed(adapters: list[Any]) -> None:
    namespace = uuid.uuid4().hex
    first = open_dict(serde=[Xor()], namespace=namespace, records=True)
    keys = make_keys(1)
    BlockingAdapterClient(first).store(keys, [memoryview(b"abc")])
    first.close()
    second = open_dict(namespace=namespace, records=True)
    adapters.append(second)
    assert BlockingAdapterClient(second).lookup_and_lock(keys).found == [False]
    assert second.stats()["corrupt_records"] == 1
    assert list(second.iter_keys()) == []


def test_a_damaged_record_payload_fails_the_load_and_is_removed(adapters: list[Any]) -> None:
    namespace = uuid.uuid4().hex
    adapter = open_dict(namespace=namespace, records=True)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter)
    keys = make_keys(1)
    client.store(keys, [memoryview(b"x" * 1000)])
    damaged = bytearray(_SPACES[namespace][keys[0]])
    damaged[-1] ^= 1
    _SPACES[namespace][keys[0]] = bytes(damaged)
    assert client.lookup_and_lock(keys).found == [True], "the header is intact"
    assert client.load(keys, [memoryview(bytearray(1000))]) == [False]
    adapter.unlock(keys)
    assert adapter.stats()["corrupt_records"] == 1
    assert client.lookup_and_lock(keys).found == [False]


def test_a_serde_refusing_to_decode_is_a_miss_not_garbage(adapters: list[Any]) -> None:
    namespace = uuid.uuid4().hex
    adapter = open_dict(serde=[Zlib()], namespace=namespace)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter)
    keys = make_keys(1)
    client.store(keys, [memoryview(COMPRESSIBLE)])
    stored = _SPACES[namespace][keys[0]]
    _SPACES[namespace][keys[0]] = stored[:10] + bytes(len(stored) - 10)
    buffer = memoryview(bytearray(len(COMPRESSIBLE)))
    assert client.load(keys, [buffer]) == [False]
    assert bytes(buffer) == bytes(len(COMPRESSIBLE)), "nothing half-decoded lands in L1"
    assert adapter.stats()["serde_decode_failures"] == 1
    assert adapter.pinned_keys() == {}


def test_record_header_carries_the_l1_size_during_put(adapters: list[Any]) -> None:
    namespace = uuid.uuid4().hex
    adapter = open_dict(serde=[Zlib()], namespace=namespace, records=True)
    adapters.append(adapter)
    keys = make_keys(1)
    BlockingAdapterClient(adapter).store(keys, [memoryview(COMPRESSIBLE)])
    header, payload = decode_record(_SPACES[namespace][keys[0]], expected_serde=("zlib",))
    assert header.l1_size == len(COMPRESSIBLE)
    assert header.payload_len == len(payload) == adapter.used_bytes()
    assert adapter.l1_size_of(keys[0]) == len(COMPRESSIBLE)


# -- failure paths ---------------------------------------------------------------------------------


class FlakyAdapter(DictAdapter):
    """Raises, answers the wrong length, or blocks in a chosen method."""

    close_timeout_s = 0.2

    def __init__(self, config: DictConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self.raise_in: set[str] = set()
        self.short_in: set[str] = set()
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}

    def block(self, method: str) -> tuple[threading.Event, threading.Event]:
        self.gates[method], self.entered[method] = threading.Event(), threading.Event()
        return self.gates[method], self.entered[method]

    def _hook(self, method: str, result: list[Any]) -> list[Any]:
        if method in self.entered:
            self.entered[method].set()
            self.gates[method].wait(30)
        if method in self.raise_in:
            raise OSError(f"injected failure in {method}")
        return result[:-1] if method in self.short_in else result

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        return self._hook("put_many", super().put_many(keys, payloads))

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        return self._hook("contains_many", super().contains_many(keys))

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        return self._hook("get_many_into", super().get_many_into(keys, buffers))

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if "delete_many" in self.entered:
            self.entered["delete_many"].set()
            self.gates["delete_many"].wait(30)
        if "delete_many" in self.raise_in:
            raise OSError("injected failure in delete_many")
        return super().delete_many(keys)


@pytest.fixture
def flaky(adapters: list[Any]) -> FlakyAdapter:
    adapter: FlakyAdapter = open_dict(FlakyAdapter)
    adapters.append(adapter)
    return adapter


def test_backend_exceptions_fail_the_batch_and_the_workers_survive(flaky: FlakyAdapter) -> None:
    client = BlockingAdapterClient(flaky, timeout=30)
    keys = make_keys(2)
    buffers = [memoryview(b"a" * 10), memoryview(b"b" * 10)]
    flaky.raise_in = {"put_many"}
    assert client.store(keys, buffers) == [False, False]
    flaky.raise_in = set()
    assert client.store(keys, buffers) == [True, True]
    flaky.raise_in = {"contains_many"}
    assert client.lookup_and_lock(keys).found == [False, False]
    flaky.raise_in = {"get_many_into"}
    assert client.load(keys, [memoryview(bytearray(10)) for _ in keys]) == [False, False]
    flaky.raise_in = {"delete_many"}
    assert flaky.delete(keys) == [False, False]
    assert flaky.pinned_keys() == {}
    flaky.raise_in = set()
    assert flaky.delete(keys) == [True, True], "a failed delete leaves no key claimed"
    assert flaky.stats()["backend_errors"] == 4


def test_a_result_of_the_wrong_length_fails_the_batch(flaky: FlakyAdapter) -> None:
    client = BlockingAdapterClient(flaky, timeout=30)
    keys = make_keys(2)
    flaky.short_in = {"put_many"}
    assert client.store(keys, [memoryview(b"a"), memoryview(b"b")]) == [False, False]
    assert flaky.used_bytes() == 0


def test_a_failing_listener_does_not_fail_operations(flaky: FlakyAdapter) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("listener bug")

    flaky.add_listener(Broken())  # type: ignore[arg-type]
    assert BlockingAdapterClient(flaky).store(make_keys(1), [memoryview(b"x")]) == [True]


def test_a_lookup_racing_a_delete_reports_a_miss(flaky: FlakyAdapter) -> None:
    client = BlockingAdapterClient(flaky, timeout=30)
    keys = make_keys(1)
    client.store(keys, [memoryview(b"x")])
    gate, entered = flaky.block("delete_many")
    outcome: list[list[bool]] = []
    deleter = threading.Thread(target=lambda: outcome.append(flaky.delete(keys)))
    deleter.start()
    assert entered.wait(30)
    assert client.lookup_and_lock(keys).found == [False], "the bytes are being deleted"
    gate.set()
    deleter.join(30)
    assert outcome == [[True]]
    assert flaky.pinned_keys() == {}


def test_a_load_holds_its_own_pin_while_copying(flaky: FlakyAdapter) -> None:
    client = BlockingAdapterClient(flaky, timeout=30)
    keys = make_keys(1)
    client.store(keys, [memoryview(b"x" * 10)])
    gate, entered = flaky.block("get_many_into")
    buffer = memoryview(bytearray(10))
    task_id = flaky.submit_load(keys, [buffer])
    assert entered.wait(30)
    assert flaky.delete(keys) == [False]
    gate.set()
    assert client.wait(L2Op.LOAD, task_id) == [True]
    assert bytes(buffer) == b"x" * 10
    assert flaky.delete(keys) == [True]


def test_close_with_a_stuck_backend_fails_the_task_and_its_late_pins_are_dropped(
    flaky: FlakyAdapter,
) -> None:
    keys = make_keys(2)
    BlockingAdapterClient(flaky).store(keys, [memoryview(b"a"), memoryview(b"b")])
    gate, entered = flaky.block("contains_many")
    task_id = flaky.submit_lookup_and_lock(keys)
    assert entered.wait(30)
    flaky.close()
    assert flaky.pop_completed_lookups() == {task_id: ([False, False], [0, 0])}
    gate.set()
    for worker in flaky._workers:
        worker.join(30)
    assert flaky.pinned_keys() == {}, "the refused result must release its pins"


def test_blocking_client_timeout_releases_an_abandoned_lookup(flaky: FlakyAdapter) -> None:
    client = BlockingAdapterClient(flaky, timeout=30)
    keys = make_keys(1)
    client.store(keys, [memoryview(b"a")])
    gate, _ = flaky.block("contains_many")
    with pytest.raises(TimeoutError):
        client.lookup_and_lock(keys, timeout=0.05)
    del flaky.entered["contains_many"]
    gate.set()
    assert client.lookup_and_lock(keys).found == [True]
    flaky.unlock(keys)
    assert flaky.pinned_keys() == {}, "the timed-out lookup's pin was dropped on arrival"


# -- the async base specifically ---------------------------------------------------------------------


class FailingOpen(AsyncDictAdapter):
    async def open_backend(self) -> None:
        raise ConnectionError("backend unreachable")


def test_async_open_failure_fails_every_operation(adapters: list[Any]) -> None:
    adapter = open_dict(FailingOpen)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    assert client.store(keys, [memoryview(b"a")]) == [False]
    assert client.lookup_and_lock(keys).found == [False]
    assert adapter.delete(keys) == [False]
    assert adapter.stats()["backend_errors"] == 3


def test_async_open_and_close_run_once_even_without_operations() -> None:
    used = open_dict(AsyncDictAdapter)
    BlockingAdapterClient(used).store(make_keys(1), [memoryview(b"a")])
    used.close()
    used.close()
    assert (used.opened, used.closed_backend) == (1, 1)
    unused = open_dict(AsyncDictAdapter)
    unused.close()
    assert (unused.opened, unused.closed_backend) == (0, 1)


def test_async_iter_keys_crosses_batches(adapters: list[Any]) -> None:
    adapter = open_dict(AsyncDictAdapter)
    adapters.append(adapter)
    keys = make_keys(2500)
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(b"k")] * len(keys)) == [True] * len(keys)
    assert sorted(adapter.iter_keys(), key=lambda k: k.chunk_hash) == keys


class StuckAsync(AsyncDictAdapter):
    close_timeout_s = 0.2

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_async_close_cancels_a_stuck_coroutine() -> None:
    adapter = open_dict(StuckAsync)
    task_id = adapter.submit_store(make_keys(1), [memoryview(b"a")])
    adapter.close()
    assert adapter.pop_completed_stores() == {task_id: [False]}
    assert adapter.closed_backend == 1


# -- pins under contention ---------------------------------------------------------------------------


@pytest.mark.parametrize("adapter_type", [DictAdapter, AsyncDictAdapter])
def test_a_found_key_stays_loadable_while_another_thread_deletes_and_restores(
    adapter_type: type[Any], adapters: list[Any]
) -> None:
    adapter = open_dict(adapter_type)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(4)
    payload = memoryview(b"p" * 64)
    assert client.store(keys, [payload] * 4) == [True] * 4
    stop = threading.Event()
    violations: list[str] = []
    deletes = [0]

    def evictor() -> None:
        while not stop.is_set():
            deleted = [k for k, ok in zip(keys, adapter.delete(keys), strict=True) if ok]
            deletes[0] += len(deleted)
            if deleted:
                client.store(deleted, [payload] * len(deleted))

    thread = threading.Thread(target=evictor)
    thread.start()
    try:
        for _ in range(300):
            found = client.lookup_and_lock(keys)
            hits = [k for k, hit in zip(keys, found.found, strict=True) if hit]
            targets = [memoryview(bytearray(64)) for _ in hits]
            loaded = client.load(hits, targets)
            if loaded != [True] * len(hits) or any(bytes(t) != bytes(payload) for t in targets):
                violations.append(f"found {len(hits)} keys, loaded {loaded}")
            adapter.unlock(hits)
    finally:
        stop.set()
        thread.join(30)
    assert violations == []
    assert deletes[0] > 0, "the evictor never got to delete anything"
    assert adapter.pinned_keys() == {}
