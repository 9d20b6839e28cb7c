"""A backend or serde that raises what is no ``Exception`` -- KeyboardInterrupt, SystemExit, a
BaseException of its own -- from a batch call: a bug of the plugin's, never a signal (a
signal is raised on the main thread only, and backend calls run on the adapter's worker
threads and event loop).  The call fails like any backend failure -- counted as a backend
error and logged on one line -- and the adapter goes on: no task left pending, no pin
left held, and an event loop that keeps serving."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import pytest
from l2_backends import AsyncDictBackend, DictBackend, open_dict

from lmcache_tiers.config import CircuitConfig, L2AdapterConfig
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.calls import call_async
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.threads import joined

SIZE = 100


class PluginAbort(BaseException):
    """A plugin's own exception that derives from BaseException."""


class RaisesOnDemand:
    """Raises ``error`` from the batch method named by ``raise_in`` when set."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.raise_in = ""
        self.error: BaseException = KeyboardInterrupt()

    def _maybe_raise(self, method: str) -> None:
        if self.raise_in == method:
            raise self.error


class RaisingSync(RaisesOnDemand, DictBackend):
    def put_many(self, keys, payloads):  # type: ignore[no-untyped-def]
        self._maybe_raise("put_many")
        return super().put_many(keys, payloads)

    def contains_many(self, keys):  # type: ignore[no-untyped-def]
        self._maybe_raise("contains_many")
        return super().contains_many(keys)

    def get_many_into(self, keys, buffers):  # type: ignore[no-untyped-def]
        self._maybe_raise("get_many_into")
        return super().get_many_into(keys, buffers)


class RaisingAsync(RaisesOnDemand, AsyncDictBackend):
    async def put_many(self, keys, payloads):  # type: ignore[no-untyped-def]
        self._maybe_raise("put_many")
        return await super().put_many(keys, payloads)

    async def contains_many(self, keys):  # type: ignore[no-untyped-def]
        self._maybe_raise("contains_many")
        return await super().contains_many(keys)

    async def get_many_into(self, keys, buffers):  # type: ignore[no-untyped-def]
        self._maybe_raise("get_many_into")
        return await super().get_many_into(keys, buffers)


#: asyncio.CancelledError too when nobody cancelled the call: a client library's own
ERRORS = [KeyboardInterrupt(), SystemExit(3), PluginAbort("plugin bug"), asyncio.CancelledError()]


def _run_once(client: BlockingAdapterClient, adapter: BackendAdapter, method: str) -> None:
    keys = make_keys(1)
    if method == "put_many":
        assert client.store(keys, [memoryview(bytes(SIZE))]) == [False]
    elif method == "contains_many":
        assert client.lookup_and_lock(keys).found == [False]
    else:
        assert client.load(keys, [memoryview(bytearray(SIZE))]) == [False]


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("method", ["put_many", "contains_many", "get_many_into"])
@pytest.mark.parametrize("backend", [RaisingSync, RaisingAsync], ids=["plain", "coroutines"])
def test_a_base_exception_from_a_batch_call_is_a_counted_backend_failure(
    adapters: list[BackendAdapter],
    backend: type[DictBackend],
    method: str,
    error: BaseException,
    caplog: pytest.LogCaptureFixture,
) -> None:
    adapter = open_dict(backend)
    adapter.close_timeout_s = 0.5
    adapters.append(adapter)
    plugin: RaisingSync = adapter.backend  # type: ignore[assignment]
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store(keys, [memoryview(bytes(SIZE))]) == [True]
    plugin.raise_in, plugin.error = method, error

    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        _run_once(client, adapter, method)

    assert adapter.stats()["backend_errors"] == 1
    assert adapter.stats().get("pending_tasks", 0) == 0
    assert adapter.pinned_keys() == {}
    failures = [r.getMessage() for r in caplog.records if f"{method} failed" in r.getMessage()]
    assert failures == [f"0:t: {method} failed: {type(error).__name__}: {error}"]
    plugin.raise_in = ""
    assert client.lookup_and_lock(keys).found == [True], "the adapter goes on serving"
    buffer = memoryview(bytearray(SIZE))
    assert client.load(keys, [buffer]) == [True]
    adapter.unlock(keys)


class RaisingSerde:
    """A serde that raises ``error`` from the stage named by ``raise_in`` when set."""

    name = "raising"

    def __init__(self) -> None:
        self.raise_in = ""
        self.error: BaseException = KeyboardInterrupt()

    def encode(self, data: memoryview, context: object) -> bytes:
        if self.raise_in == "encode":
            raise self.error
        return bytes(data)

    def decode(self, data: memoryview, context: object) -> bytes:
        if self.raise_in == "decode":
            raise self.error
        return bytes(data)


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("stage", ["encode", "decode"])
@pytest.mark.parametrize("backend", [DictBackend, AsyncDictBackend], ids=["plain", "coroutines"])
def test_a_serde_raising_a_base_exception_fails_its_object_counted(
    adapters: list[BackendAdapter],
    backend: type[DictBackend],
    stage: str,
    error: BaseException,
    caplog: pytest.LogCaptureFixture,
) -> None:
    serde = RaisingSerde()
    adapter = open_dict(backend, serde=(serde,))
    adapter.close_timeout_s = 0.5
    adapters.append(adapter)
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    if stage == "decode":
        assert client.store(keys, [memoryview(b"s" * SIZE)]) == [True]
    serde.raise_in, serde.error = stage, error

    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        if stage == "encode":
            assert client.store(keys, [memoryview(b"s" * SIZE)]) == [False]
        else:
            assert client.lookup_and_lock(keys).found == [True]
            buffer = memoryview(bytearray(SIZE))
            assert client.load(keys, [buffer]) == [False]
            assert bytes(buffer) == bytes(SIZE), "no byte of a failed decode reaches L1"
            adapter.unlock(keys)

    assert adapter.stats()[f"serde_{stage}_failures"] == 1
    assert adapter.stats().get("pending_tasks", 0) == 0
    assert any(f"serde {stage} failed" in record.getMessage() for record in caplog.records)
    serde.raise_in = ""
    later = make_keys(2)[1:]
    assert client.store(later, [memoryview(b"t" * SIZE)]) == [True], "the adapter goes on serving"
    assert client.lookup_and_lock(later).found == [True]
    buffer = memoryview(bytearray(SIZE))
    assert client.load(later, [buffer]) == [True]
    assert bytes(buffer) == b"t" * SIZE
    adapter.unlock(later)


class NeverAnswering:
    """A coroutine backend whose load waits for an answer that never comes."""

    async def get_many_into(self, keys, buffers):  # type: ignore[no-untyped-def]
        await asyncio.get_running_loop().create_future()


def test_a_coroutine_call_closed_while_it_awaits_the_backend_is_no_backend_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call's coroutine closed while it awaits the backend (a task dropped with its event
    loop) gets GeneratorExit thrown in: Python's way of closing it, not the plugin's failure.
    Caught as one, the close fails ("coroutine ignored GeneratorExit") and an error that never
    happened is counted."""
    state = AdapterState(AdapterContext(index=0, name="0:t", config=L2AdapterConfig()))
    outcome: list[BaseException | None] = []

    def call_then_close() -> None:  # off the main thread, as the adapter's loop runs
        loop = asyncio.new_event_loop()
        coroutine = call_async(
            state, NeverAnswering(), "get_many_into", make_keys(1), memoryview(bytearray(1))
        )
        task = loop.create_task(coroutine)
        loop.run_until_complete(asyncio.sleep(0))  # the call now awaits the backend
        assert not task.done()
        loop.close()
        try:
            coroutine.close()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    worker = threading.Thread(target=call_then_close)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        worker.start()
        worker.join()
    assert outcome == [None], "the close went through"
    assert state.counters.snapshot().get("backend_errors", 0) == 0
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == []


#: a circuit that opens after three failed calls and probes every 20 ms
FAST_CIRCUIT = CircuitConfig(failure_threshold=3, probe_interval_s=0.02)


class RemoteRaisingSync(RaisingSync):
    """A store across a network (its calls go through the circuit breaker) whose ``ping``
    raises ``ping_error`` when set."""

    remote = True
    ping_error: BaseException | None = None

    def ping(self) -> None:
        if self.ping_error is not None:
            raise self.ping_error


class RemoteRaisingAsync(RaisingAsync):
    remote = True
    ping_error: BaseException | None = None

    async def ping(self) -> None:
        if self.ping_error is not None:
            raise self.ping_error


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30.0  # guards against hangs only
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("error", ERRORS[:3], ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("backend", [RemoteRaisingSync, RemoteRaisingAsync], ids=["plain", "coroutines"])
def test_base_exceptions_from_a_remote_backend_open_its_circuit_and_a_probe_raising_one_fails(
    adapters: list[BackendAdapter], backend: type[DictBackend], error: BaseException
) -> None:
    """Counted as backend errors, they count toward opening the circuit as any failed call
    does: a store calling ``sys.exit()`` on every call is refused, not called for ever.  A
    probe raising one is a failed probe, and probing goes on (escaping, it would end the
    probing, or the adapter's event loop, with the circuit open for good)."""
    adapter = open_dict(backend, circuit=FAST_CIRCUIT)
    adapters.append(adapter)
    plugin: RemoteRaisingSync = adapter.backend.inner  # type: ignore[attr-defined]  # inside the breaker
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store(keys, [memoryview(bytes(SIZE))]) == [True]
    plugin.raise_in, plugin.error, plugin.ping_error = "put_many", error, error
    for batch in range(3):
        assert client.store(make_keys(1, start=batch + 1), [memoryview(bytes(SIZE))]) == [False]
    stats = adapter.stats()
    assert stats["backend_errors"] == 3 and stats.get("circuit_failures", 0) == 3, stats
    assert stats["circuit_open"] == 1, stats

    _wait_for(lambda: adapter.stats().get("circuit_probe_failures", 0) >= 2, "probes that raised")
    plugin.raise_in, plugin.ping_error = "", None
    _wait_for(lambda: adapter.stats()["circuit_open"] == 0, "a probe to close the circuit")
    assert client.lookup_and_lock(keys).found == [True]
    adapter.unlock(keys)


class ExitingIndex(DictBackend):
    """A backend whose in-memory index (``contains_many_now``) raises ``error``."""

    error: BaseException = SystemExit(5)

    def contains_many_now(self, keys):  # type: ignore[no-untyped-def]
        raise self.error


@pytest.mark.parametrize("error", ERRORS[:3], ids=lambda error: type(error).__name__)
def test_a_base_exception_from_an_immediate_lookup_off_the_main_thread_is_a_counted_fallback(
    adapters: list[BackendAdapter], error: BaseException
) -> None:
    """A front end's request thread asks the index on its own thread: what the plugin raises
    there is its failure -- counted, the pins given back and the lookup left to the
    adapter's worker -- not an exception that ends the request's thread."""
    adapter = open_dict(ExitingIndex)
    adapters.append(adapter)
    keys = make_keys(2)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store(keys[:1], [memoryview(bytes(SIZE))]) == [True]
    adapter.backend.error = error  # type: ignore[attr-defined]
    answers: list[object] = []

    def ask() -> None:
        try:
            answers.append(adapter.lookup_and_lock_now(keys))
        except BaseException as exc:
            answers.append(exc)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    joined(asker, "the request thread's lookup_and_lock_now")
    assert answers == [None]
    assert adapter.stats()["backend_errors"] == 1
    assert adapter.pinned_keys() == {}
    assert client.lookup_and_lock(keys).found == [True, False], "the worker's lookup answers"
    adapter.unlock(keys[:1])
