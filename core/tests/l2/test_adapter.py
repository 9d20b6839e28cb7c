"""The composed adapter: the conformance suite on small dict backends (sync and async,
with and without record headers and serdes), then the failure paths the suite cannot reach
through a well-behaved backend."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from l2_backends import _SPACES, AsyncDictBackend, DictBackend, DictConfig, Xor, Zlib, open_dict

import lmcache_tiers.testing.base as testing_base
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, BackendContext, L2Op, ObjectSize
from lmcache_tiers.l2.adapter import BackendCloseFailed, BackendCloseTimedOut
from lmcache_tiers.l2.record import decode_record
from lmcache_tiers.plugins import PluginSet
from lmcache_tiers.registry import KindRegistry
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import CAPACITY, EVICTION, PERSISTENCE, L2AdapterSuite, make_keys
from lmcache_tiers.testing.registries import plugins_with


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("test_dict", DictBackend, DictConfig)
    registry.add("test_async_dict", AsyncDictBackend, DictConfig)


def plugins_with_test_backends() -> PluginSet:
    """The installed plugins plus this module's test backends, discovered once."""
    return plugins_with("test-dict-backends", tiers_register_l2_adapters=tiers_register_l2_adapters)


# -- the conformance suite on every flavour ----------------------------------------------------


class _DictSuite(L2AdapterSuite):
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})
    records = False

    @pytest.fixture(autouse=True)
    def _test_plugins(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(testing_base, "load_plugins", plugins_with_test_backends)

    def make_config(self) -> DictConfig:
        return DictConfig(namespace=uuid.uuid4().hex, capacity=256 << 10, records=self.records)


class TestSyncBackend(_DictSuite):
    component_name = "test_dict"


class TestAsyncBackend(_DictSuite):
    component_name = "test_async_dict"


class TestSyncBackendWithRecordsAndSerde(_DictSuite):
    component_name = "test_dict"
    records = True
    serde = (Xor(),)


class TestAsyncBackendWithRecordsAndSerde(_DictSuite):
    component_name = "test_async_dict"
    records = True
    serde = (Xor(),)


# -- serde and records beyond the suite ---------------------------------------------------------


COMPRESSIBLE = b"kv-cache " * 2000


@pytest.mark.parametrize("backend", [DictBackend, AsyncDictBackend])
def test_size_changing_serde_reports_l1_sizes_and_accounts_stored_bytes(
    backend: type[DictBackend], adapters: list[BackendAdapter]
) -> None:
    adapter = open_dict(backend, serde=[Zlib()])
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


def test_records_recover_l1_sizes_after_a_restart(adapters: list[BackendAdapter]) -> None:
    namespace = uuid.uuid4().hex
    first = open_dict(serde=[Zlib()], namespace=namespace, records=True)
    keys = make_keys(1)
    assert BlockingAdapterClient(first).store(keys, [memoryview(COMPRESSIBLE)]) == [True]
    stored = first.used_bytes()
    first.close()
    second = open_dict(serde=[Zlib()], namespace=namespace, records=True)
    adapters.append(second)
    client = BlockingAdapterClient(second)
    assert second.used_bytes() == stored, "the start-up scan accounts the stored bytes"
    assert second.l1_size_of(keys[0]) is None, "the listing gave stored sizes only"
    assert client.lookup_and_lock(keys).sizes == [len(COMPRESSIBLE)]
    assert second.l1_size_of(keys[0]) == len(COMPRESSIBLE), "learnt from the record header"
    assert second.used_bytes() == stored
    buffer = memoryview(bytearray(len(COMPRESSIBLE)))
    assert client.load(keys, [buffer]) == [True] and bytes(buffer) == COMPRESSIBLE
    second.unlock(keys)


def test_without_records_an_unknown_l1_size_is_a_miss(adapters: list[BackendAdapter]) -> None:
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


def test_a_record_of_another_serde_chain_is_a_counted_miss_and_kept(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    namespace = uuid.uuid4().hex
    first = open_dict(serde=[Xor()], namespace=namespace, records=True)
    keys = make_keys(2)
    BlockingAdapterClient(first).store(keys, [memoryview(b"abc")] * 2)
    first.close()
    second = open_dict(namespace=namespace, records=True)
    adapters.append(second)
    client = BlockingAdapterClient(second)
    backend: DictBackend = second.backend  # type: ignore[assignment]
    assert client.lookup_and_lock(keys).found == [False, False]
    assert second.stats()["serde_chain_mismatch"] == 2
    logged = [r for r in caplog.records if "written with serde chain" in r.getMessage()]
    assert len(logged) == 1, "logged once per burst"
    assert set(second.iter_keys()) == set(keys), "kept: restoring the chain makes it readable"
    calls = backend.calls["contains_many"]
    assert client.lookup_and_lock(keys).found == [False, False]
    assert backend.calls["contains_many"] == calls, "known mismatches are missed without I/O"
    assert client.store(keys[:1], [memoryview(b"new")]) == [True]
    result = client.lookup_and_lock(keys)
    assert result.found == [True, False], "a store with this chain replaces the record"
    second.unlock(keys[:1])
    assert second.stats().get("corrupt_records_removed", 0) == 0


def test_a_damaged_record_payload_fails_the_load_and_is_removed(adapters: list[BackendAdapter]) -> None:
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
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert client.lookup_and_lock(keys).found == [False]


def test_a_serde_refusing_to_decode_is_a_miss_not_garbage(adapters: list[BackendAdapter]) -> None:
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
    # Decoding it again would fail again: a miss until it is replaced, not a hit whose
    # every load reads the object and fails.
    assert client.lookup_and_lock(keys).found == [False]
    client.store(keys, [memoryview(COMPRESSIBLE)])
    assert client.lookup_and_lock(keys).found == [True], "a store replaces the record"
    assert client.load(keys, [buffer]) == [True]
    adapter.unlock(keys)
    assert bytes(buffer) == COMPRESSIBLE


def test_record_header_carries_the_l1_size_during_put(adapters: list[BackendAdapter]) -> None:
    namespace = uuid.uuid4().hex
    adapter = open_dict(serde=[Zlib()], namespace=namespace, records=True)
    adapters.append(adapter)
    keys = make_keys(1)
    layout = f"uint8[{len(COMPRESSIBLE)}]"
    BlockingAdapterClient(adapter).store(keys, [memoryview(COMPRESSIBLE)], layouts=[layout])
    header, payload = decode_record(_SPACES[namespace][keys[0]], expected_serde=(Zlib.name,))
    assert header.l1_size == len(COMPRESSIBLE)
    assert header.layout == layout
    assert header.payload_len == len(payload) == adapter.used_bytes()
    assert adapter.l1_size_of(keys[0]) == len(COMPRESSIBLE)


class HeldFirstStore(AsyncDictBackend):
    """Holds the first ``put_many`` until ``release`` is set (before it writes anything)."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.held = False

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        if not self.held:
            self.held = True
            self.entered.set()
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        return await super().put_many(keys, payloads)


def test_overlapping_stores_of_one_key_each_write_their_own_header(adapters: list[BackendAdapter]) -> None:
    namespace = uuid.uuid4().hex
    adapter = open_dict(HeldFirstStore, serde=[Zlib()], namespace=namespace, records=True)
    adapters.append(adapter)
    backend: HeldFirstStore = adapter.backend  # type: ignore[assignment]
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    first, second = COMPRESSIBLE, COMPRESSIBLE * 2
    held = adapter.submit_store(keys, [memoryview(first)], layouts=["first"])
    assert backend.entered.wait(30)
    # A later store of the key lands first and ends while the held one is in its call.
    assert client.store(keys, [memoryview(second)], layouts=["second"]) == [True]
    backend.release.set()
    assert client.wait(L2Op.STORE, held) == [True]
    header, _ = decode_record(_SPACES[namespace][keys[0]], expected_serde=(Zlib.name,))
    assert (header.l1_size, header.layout) == (len(first), "first"), "the header describes its payload"
    assert client.lookup_and_lock(keys).sizes == [len(first)]
    buffer = memoryview(bytearray(len(first)))
    assert client.load(keys, [buffer]) == [True]
    adapter.unlock(keys)
    assert bytes(buffer) == first


class HeldRead(DictBackend):
    """Once ``hold`` is set, a lookup or load reads its records, then waits for ``release``
    before judging them: a store of the key may replace the record in between."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.hold = False
        self.read = threading.Event()
        self.release = threading.Event()

    def _held(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        with self.lock:
            values = [self.objects.get(key) for key in keys]
        self.hold = False
        self.read.set()
        assert self.release.wait(30)
        return values

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        if not self.hold:
            return super().contains_many(keys)
        self._called("contains_many")
        values = self._held(keys)
        return [None if v is None else self._size(k, v) for k, v in zip(keys, values, strict=True)]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        if not self.hold:
            return super().get_many_into(keys, buffers)
        self._called("get_many_into")
        ok = []
        for key, buffer, value in zip(keys, buffers, self._held(keys), strict=True):
            payload = None if value is None else self._payload(key, value)
            if payload is not None and len(payload) == buffer.nbytes:
                buffer[:] = payload
            ok.append(payload is not None and len(payload) == buffer.nbytes)
        return ok


def test_a_lookup_that_read_a_record_a_store_replaced_meanwhile_leaves_the_key_readable(
    adapters: list[BackendAdapter],
) -> None:
    """The lookup read a record of another serde chain; a store with this chain replaced
    it before the lookup judged it: the lookup is a miss, but the key is not marked a miss
    until stored again -- the record there now is readable."""
    namespace = uuid.uuid4().hex
    first = open_dict(serde=[Xor()], namespace=namespace, records=True)
    keys = make_keys(1)
    BlockingAdapterClient(first).store(keys, [memoryview(b"old")])
    first.close()
    adapter = open_dict(HeldRead, namespace=namespace, records=True)
    adapters.append(adapter)
    backend: HeldRead = adapter.backend  # type: ignore[assignment]
    client = BlockingAdapterClient(adapter, timeout=30)
    backend.hold = True
    lookup = adapter.submit_lookup_and_lock(keys)
    assert backend.read.wait(30)
    assert client.store(keys, [memoryview(b"new")]) == [True]
    backend.release.set()
    assert client.wait(L2Op.LOOKUP, lookup).found == [False], "it read the old record"
    assert adapter.stats()["serde_chain_mismatch"] == 1
    assert client.lookup_and_lock(keys).found == [True], "the record there now is readable"
    buffer = memoryview(bytearray(3))
    assert client.load(keys, [buffer]) == [True]
    adapter.unlock(keys)
    assert bytes(buffer) == b"new"


def test_a_load_that_read_a_record_a_store_replaced_meanwhile_leaves_the_key_readable(
    adapters: list[BackendAdapter],
) -> None:
    """The load read a payload its serde cannot decode; a store replaced the record before
    the load decoded it: the load is a miss, but the key stays readable."""
    namespace = uuid.uuid4().hex
    adapter = open_dict(HeldRead, serde=[Zlib()], namespace=namespace)
    adapters.append(adapter)
    backend: HeldRead = adapter.backend  # type: ignore[assignment]
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    client.store(keys, [memoryview(COMPRESSIBLE)])
    stored = _SPACES[namespace][keys[0]]
    _SPACES[namespace][keys[0]] = stored[:10] + bytes(len(stored) - 10)
    buffer = memoryview(bytearray(len(COMPRESSIBLE)))
    backend.hold = True
    load = adapter.submit_load(keys, [buffer])
    assert backend.read.wait(30)
    assert client.store(keys, [memoryview(COMPRESSIBLE)]) == [True]
    backend.release.set()
    assert client.wait(L2Op.LOAD, load) == [False], "it read the old record"
    assert adapter.stats()["serde_decode_failures"] == 1
    assert client.lookup_and_lock(keys).found == [True], "the record there now is readable"
    assert client.load(keys, [buffer]) == [True]
    adapter.unlock(keys)
    assert bytes(buffer) == COMPRESSIBLE


# -- failure paths ---------------------------------------------------------------------------------


class FlakyBackend(DictBackend):
    """Raises, answers the wrong length, or blocks in a chosen method."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
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
def flaky(adapters: list[BackendAdapter]) -> tuple[BackendAdapter, FlakyBackend]:
    adapter = open_dict(FlakyBackend)
    adapter.close_timeout_s = 0.2
    adapters.append(adapter)
    backend: FlakyBackend = adapter.backend  # type: ignore[assignment]
    return adapter, backend


def test_backend_exceptions_fail_the_batch_and_the_workers_survive(
    flaky: tuple[BackendAdapter, FlakyBackend],
) -> None:
    adapter, backend = flaky
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(2)
    buffers = [memoryview(b"a" * 10), memoryview(b"b" * 10)]
    backend.raise_in = {"put_many"}
    assert client.store(keys, buffers) == [False, False]
    backend.raise_in = set()
    assert client.store(keys, buffers) == [True, True]
    backend.raise_in = {"contains_many"}
    assert client.lookup_and_lock(keys).found == [False, False]
    backend.raise_in = {"get_many_into"}
    assert client.load(keys, [memoryview(bytearray(10)) for _ in keys]) == [False, False]
    backend.raise_in = {"delete_many"}
    assert adapter.delete(keys) == [False, False]
    assert adapter.pinned_keys() == {}
    backend.raise_in = set()
    assert adapter.delete(keys) == [True, True], "a failed delete leaves no key claimed"
    assert adapter.stats()["backend_errors"] == 4


def test_a_result_of_the_wrong_length_fails_the_batch(flaky: tuple[BackendAdapter, FlakyBackend]) -> None:
    adapter, backend = flaky
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(2)
    backend.short_in = {"put_many"}
    assert client.store(keys, [memoryview(b"a"), memoryview(b"b")]) == [False, False]
    assert adapter.used_bytes() == 0


class WrongKinds(DictBackend):
    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        return [True] * len(keys)  # a bool is not a size


def test_a_lookup_result_of_the_wrong_kind_fails_the_batch(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(WrongKinds)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(2)
    assert client.store(keys, [memoryview(b"a"), memoryview(b"b")]) == [True, True]
    assert client.lookup_and_lock(keys).found == [False, False]
    assert adapter.stats()["backend_errors"] == 1
    assert adapter.pinned_keys() == {}


class ByteCounts(DictBackend):
    """Answers loads and stores with byte counts, as ``readinto`` does, not booleans."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[Any]:
        super().put_many(keys, payloads)
        return [payload.nbytes for payload in payloads]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[Any]:
        for key, buffer in zip(keys, buffers, strict=True):  # a short read: half the bytes
            half = buffer.nbytes // 2
            buffer[:half] = self.objects[key][:half]
        return [buffer.nbytes // 2 for buffer in buffers]


def test_store_and_load_results_that_are_not_booleans_fail_the_batch(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(ByteCounts)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    assert client.store(keys, [memoryview(b"x" * 10)]) == [False], "a count is not an acknowledgement"
    assert adapter.used_bytes() == 0
    adapter.backend.objects[keys[0]] = b"x" * 10  # type: ignore[attr-defined]
    buffer = memoryview(bytearray(10))
    assert client.load(keys, [buffer]) == [False], "half the bytes are garbage, not a hit"
    assert adapter.stats()["backend_errors"] == 2
    assert adapter.pinned_keys() == {}


def test_a_failing_listener_does_not_fail_operations(flaky: tuple[BackendAdapter, FlakyBackend]) -> None:
    adapter, _ = flaky

    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("listener bug")

    adapter.add_listener(Broken())  # type: ignore[arg-type]
    assert BlockingAdapterClient(adapter).store(make_keys(1), [memoryview(b"x")]) == [True]


def test_a_lookup_racing_a_delete_reports_a_miss(flaky: tuple[BackendAdapter, FlakyBackend]) -> None:
    adapter, backend = flaky
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    client.store(keys, [memoryview(b"x")])
    gate, entered = backend.block("delete_many")
    outcome: list[list[bool]] = []
    deleter = threading.Thread(target=lambda: outcome.append(adapter.delete(keys)))
    deleter.start()
    assert entered.wait(30)
    assert client.lookup_and_lock(keys).found == [False], "the bytes are being deleted"
    gate.set()
    deleter.join(30)
    assert outcome == [[True]]
    assert adapter.pinned_keys() == {}


def test_a_load_holds_its_own_pin_while_copying(flaky: tuple[BackendAdapter, FlakyBackend]) -> None:
    adapter, backend = flaky
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    client.store(keys, [memoryview(b"x" * 10)])
    gate, entered = backend.block("get_many_into")
    buffer = memoryview(bytearray(10))
    task_id = adapter.submit_load(keys, [buffer])
    assert entered.wait(30)
    assert adapter.delete(keys) == [False]
    gate.set()
    assert client.wait(L2Op.LOAD, task_id) == [True]
    assert bytes(buffer) == b"x" * 10
    assert adapter.delete(keys) == [True]


def test_close_with_a_stuck_backend_fails_the_task_and_its_late_pins_are_dropped(
    flaky: tuple[BackendAdapter, FlakyBackend],
) -> None:
    adapter, backend = flaky
    keys = make_keys(2)
    BlockingAdapterClient(adapter).store(keys, [memoryview(b"a"), memoryview(b"b")])
    gate, entered = backend.block("contains_many")
    task_id = adapter.submit_lookup_and_lock(keys)
    assert entered.wait(30)
    adapter.close()
    assert adapter.pop_completed_lookups() == {task_id: ([False, False], [0, 0])}
    gate.set()
    for worker in adapter.runner.threads():  # type: ignore[attr-defined]
        worker.join(30)
    assert adapter.pinned_keys() == {}, "the refused result must release its pins"


def test_blocking_client_timeout_releases_an_abandoned_lookup(
    flaky: tuple[BackendAdapter, FlakyBackend],
) -> None:
    adapter, backend = flaky
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    client.store(keys, [memoryview(b"a")])
    gate, _ = backend.block("contains_many")
    with pytest.raises(TimeoutError):
        client.lookup_and_lock(keys, timeout=0.05)
    del backend.entered["contains_many"]
    gate.set()
    assert client.lookup_and_lock(keys).found == [True]
    adapter.unlock(keys)
    assert adapter.pinned_keys() == {}, "the timed-out lookup's pin was dropped on arrival"


# -- coroutine backends specifically -----------------------------------------------------------------


class FailingOpen(AsyncDictBackend):
    async def open(self) -> None:
        raise ConnectionError("backend unreachable")


def test_async_open_failure_fails_every_operation(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(FailingOpen)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    assert client.store(keys, [memoryview(b"a")]) == [False]
    assert client.lookup_and_lock(keys).found == [False]
    assert adapter.delete(keys) == [False]
    assert adapter.stats()["backend_errors"] == 3
    assert adapter.stats()["open_failures"] == 1


def test_async_open_and_close_run_once() -> None:
    used = open_dict(AsyncDictBackend)
    BlockingAdapterClient(used).store(make_keys(1), [memoryview(b"a")])
    used.close()
    used.close()
    backend: AsyncDictBackend = used.backend  # type: ignore[assignment]
    assert (backend.opened, backend.closed) == (1, 1)
    unused = open_dict(AsyncDictBackend)
    unused.close()
    backend = unused.backend  # type: ignore[assignment]
    assert (backend.opened, backend.closed) == (1, 1), "opened at start: the scan lists the keys"


def test_async_iter_keys_crosses_batches(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(AsyncDictBackend)
    adapters.append(adapter)
    keys = make_keys(2500)
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(b"k")] * len(keys)) == [True] * len(keys)
    assert sorted(adapter.iter_keys(), key=lambda k: k.chunk_hash) == keys


class StuckAsync(AsyncDictBackend):
    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_async_close_cancels_a_stuck_coroutine() -> None:
    adapter = open_dict(StuckAsync)
    adapter.close_timeout_s = 0.2
    task_id = adapter.submit_store(make_keys(1), [memoryview(b"a")])
    adapter.close()
    assert adapter.pop_completed_stores() == {task_id: [False]}
    backend: StuckAsync = adapter.backend  # type: ignore[assignment]
    assert backend.closed == 1


class HungClose(DictBackend):
    """A backend whose close never returns while ``gate`` is clear (a hung mount)."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.entered, self.gate = threading.Event(), threading.Event()

    def close(self) -> None:
        self.entered.set()
        self.gate.wait(60)


class AsyncHungClose(AsyncDictBackend):
    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.entered, self.gate = threading.Event(), threading.Event()

    async def close(self) -> None:
        self.entered.set()
        while not self.gate.is_set():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("backend", [HungClose, AsyncHungClose], ids=["plain", "coroutines"])
def test_a_backend_close_that_hangs_does_not_hang_the_adapters_close(
    backend: type[HungClose], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = open_dict(backend)
    adapter.close_backend_timeout_s = 0.2  # type: ignore[misc]
    hung: HungClose = adapter.backend  # type: ignore[assignment]
    closed = threading.Event()
    raised: list[BaseException] = []

    def close() -> None:
        try:
            adapter.close()
        except BaseException as exc:
            raised.append(exc)
        closed.set()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    try:
        assert hung.entered.wait(10)
        closer.join(10)
        assert closed.is_set(), "the adapter's close waited for a backend close that hangs"
        # It returns, but as a failed close: what the backend left undone may matter.
        assert [type(exc) for exc in raised] == [BackendCloseTimedOut]
        assert "did not return in 0.2 s" in str(raised[0])
        assert adapter.stats()["backend_close_timeouts"] == 1
        assert "close of the backend did not return" in caplog.text
    finally:
        hung.gate.set()
        closer.join(30)


# -- pins under contention ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [DictBackend, AsyncDictBackend])
def test_a_found_key_stays_loadable_while_another_thread_deletes_and_restores(
    backend: type[DictBackend], adapters: list[BackendAdapter]
) -> None:
    adapter = open_dict(backend)
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


class FailingClose(DictBackend):
    """A backend whose own close raises (a checkpoint or flush it could not write)."""

    def close(self) -> None:
        raise OSError(5, "Input/output error")


class AsyncFailingClose(AsyncDictBackend):
    async def close(self) -> None:
        raise OSError(5, "Input/output error")


@pytest.mark.parametrize("backend", [FailingClose, AsyncFailingClose], ids=["plain", "coroutines"])
def test_a_backend_close_that_raises_is_counted_and_fails_the_adapters_close(
    backend: type[FailingClose], caplog: pytest.LogCaptureFixture
) -> None:
    # What the backend's close left undone (a last checkpoint, commit words) may bring back
    # deleted objects at the next start: the stop must not pass for a clean one.
    adapter = open_dict(backend)
    failed = r"closing the backend failed: OSError: .*Input/output error"
    with pytest.raises(BackendCloseFailed, match=failed):
        adapter.close()
    assert adapter.stats()["backend_close_failures"] == 1
    assert "closing the backend failed" not in caplog.text, "logged here and again by the caller"
    adapter.close()  # a second close is a no-op, not a second failure
    assert adapter.stats()["backend_close_failures"] == 1
