"""The circuit breaker in front of a backend: opens on repeated failures, fails fast while
open, probes, and closes by itself once the backend answers again."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from l2_backends import AsyncDictBackend, DictBackend, DictConfig, open_dict

from lmcache_tiers.config import CircuitConfig, decode_adapter
from lmcache_tiers.errors import ConfigError, PartialFailure
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.calls import NotCalled
from lmcache_tiers.l2.circuit import PROBE_KEY, TIMED_HELPERS, AsyncCircuitBackend, CircuitBackend
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

WAIT_S = 30.0  # guards against hangs only


class Outage:
    """A switch every test backend consults: down (raise), hung (block) or up."""

    def __init__(self) -> None:
        self.down = False
        self.hang = threading.Event()
        self.released = threading.Event()
        self.pings = 0
        #: calls end in a CancelledError of the client library's own (nobody cancelled them)
        self.cancelled = False

    def check(self) -> None:
        if self.hang.is_set():
            self.released.wait(WAIT_S)
        if self.down:
            raise ConnectionError("store unreachable")
        if self.cancelled:
            raise asyncio.CancelledError


OUTAGE = Outage()


@pytest.fixture(autouse=True)
def outage() -> Outage:
    global OUTAGE
    OUTAGE = Outage()
    yield OUTAGE
    OUTAGE.released.set()


class RemoteDict(DictBackend):
    """A dict that behaves like a store across a network: it fails while the outage lasts."""

    remote = True

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        OUTAGE.check()
        return super().put_many(keys, payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        OUTAGE.check()
        return super().contains_many(keys)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        OUTAGE.check()
        return super().get_many_into(keys, buffers)

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        OUTAGE.check()
        return super().delete_many(keys)


class PingingRemoteDict(RemoteDict):
    def ping(self) -> None:
        OUTAGE.pings += 1
        OUTAGE.check()


class LocalDict(RemoteDict):
    remote = False


class AsyncRemoteDict(AsyncDictBackend):
    remote = True

    async def _check(self) -> None:
        await asyncio.sleep(0)
        if OUTAGE.hang.is_set():
            await asyncio.sleep(WAIT_S)
        if OUTAGE.down:
            raise ConnectionError("store unreachable")
        if OUTAGE.cancelled:
            raise asyncio.CancelledError

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        await self._check()
        return await super().put_many(keys, payloads)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:  # type: ignore[override]
        await self._check()
        return await super().contains_many(keys)

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        await self._check()
        return await super().get_many_into(keys, buffers)

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:  # type: ignore[override]
        await self._check()
        return await super().delete_many(keys)


FAST = CircuitConfig(failure_threshold=3, probe_interval_s=0.02)


def wait_for(condition: Callable[[], bool], what: str, within: float = WAIT_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def opened(adapters: list[BackendAdapter], backend: type[DictBackend], **config: Any) -> BackendAdapter:
    config.setdefault("circuit", FAST)
    adapter = open_dict(backend, **config)
    adapters.append(adapter)
    return adapter


def fail_lookups(client: BlockingAdapterClient, keys: list[ObjectKey], times: int) -> None:
    for _ in range(times):
        assert client.lookup_and_lock(keys).found == [False] * len(keys)


def store(client: BlockingAdapterClient, keys: list[ObjectKey], data: bytes = b"v" * 100) -> list[bool]:
    return client.store(keys, [memoryview(bytearray(data)) for _ in keys])


@pytest.mark.parametrize("backend", [RemoteDict, AsyncRemoteDict], ids=["plain", "coroutines"])
def test_failures_open_the_circuit_and_a_probe_closes_it(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend]
) -> None:
    adapter = opened(adapters, backend)
    guard = adapter.backend
    assert isinstance(guard, AsyncCircuitBackend if backend is AsyncRemoteDict else CircuitBackend)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(2)
    assert store(client, keys) == [True, True]
    assert adapter.stats()["circuit_open"] == 0

    outage.down = True
    fail_lookups(client, keys, 3)
    stats = adapter.stats()
    assert stats["circuit_open"] == 1 and stats["circuit_opened"] == 1
    assert stats["circuit_failures"] == 3 and stats["backend_errors"] == 3

    # Open: nothing reaches the backend; every refusal is counted.
    calls = dict(guard.inner.calls)
    assert client.lookup_and_lock(keys).found == [False, False]
    assert store(client, make_keys(3, start=10)) == [False] * 3
    assert client.load(keys, [memoryview(bytearray(100)) for _ in keys]) == [False, False]
    assert adapter.delete(keys[:1]) == [False]
    assert guard.inner.calls == calls
    stats = adapter.stats()
    assert stats["circuit_missed_lookup_keys"] == 2
    assert stats["circuit_skipped_store_keys"] == 3
    assert stats["circuit_failed_load_keys"] == 2
    assert stats["circuit_failed_delete_keys"] == 1
    assert stats["backend_errors"] == 3, "refusals are not backend calls"
    wait_for(lambda: adapter.stats().get("circuit_probe_failures", 0) >= 2, "failed probes")

    outage.down = False
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
    stats = adapter.stats()
    assert stats["circuit_closed"] == 1 and stats["circuit_probes"] >= 3
    found = client.lookup_and_lock(keys)
    assert found.found == [True, True]
    loaded = [memoryview(bytearray(100)) for _ in keys]
    assert client.load(keys, loaded) == [True, True]
    assert [bytes(b) for b in loaded] == [b"v" * 100] * 2
    adapter.unlock(keys)


@pytest.mark.parametrize("backend", [RemoteDict, AsyncRemoteDict], ids=["plain", "coroutines"])
def test_refused_calls_release_nothing_the_adapter_accounts(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend]
) -> None:
    """A refused lookup is a miss, not "absent": the keys are still accounted, and a
    refused delete does not ask whether they are gone."""
    adapter = opened(adapters, backend)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(2)
    assert store(client, keys) == [True, True]
    used = adapter.used_bytes()
    outage.down = True
    fail_lookups(client, keys, 3)
    assert adapter.stats()["circuit_open"] == 1
    assert adapter.used_bytes() == used, "a failed lookup says nothing about the keys"

    assert client.lookup_and_lock(keys).found == [False, False]
    assert adapter.delete(keys) == [False, False]
    assert adapter.used_bytes() == used
    stats = adapter.stats()
    assert stats["circuit_missed_lookup_keys"] == 2 and stats["circuit_failed_delete_keys"] == 2
    assert "objects_vanished" not in stats and "delete_keys_checked" not in stats
    assert stats["backend_errors"] == 3, "refusals are not backend calls"


@pytest.mark.parametrize("backend", [RemoteDict, AsyncRemoteDict], ids=["plain", "coroutines"])
def test_the_circuit_opens_again_after_it_closed(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend]
) -> None:
    adapter = opened(adapters, backend)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    for round_number in (1, 2):
        outage.down = True
        fail_lookups(client, keys, 3)
        assert adapter.stats()["circuit_opened"] == round_number
        outage.down = False
        wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
        assert adapter.stats()["circuit_closed"] == round_number
    assert store(client, keys) == [True]


def test_a_success_resets_the_count_of_consecutive_failures(
    adapters: list[BackendAdapter], outage: Outage
) -> None:
    adapter = opened(adapters, RemoteDict)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    for _ in range(3):
        outage.down = True
        fail_lookups(client, keys, 2)
        assert adapter.stats()["circuit_consecutive_failures"] == 2
        outage.down = False
        fail_lookups(client, keys, 1)
        assert adapter.stats()["circuit_consecutive_failures"] == 0
    assert adapter.stats()["circuit_open"] == 0
    assert adapter.stats()["circuit_failures"] == 6


def test_the_probe_uses_ping_when_the_backend_has_one(adapters: list[BackendAdapter], outage: Outage) -> None:
    adapter = opened(adapters, PingingRemoteDict)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    outage.down = True
    fail_lookups(client, make_keys(1), 3)
    wait_for(lambda: outage.pings >= 2, "pings")
    assert adapter.backend.inner.calls.get("contains_many", 0) == 0
    outage.down = False
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")


def test_without_ping_the_probe_asks_about_a_key_nobody_stores(adapters: list[BackendAdapter]) -> None:
    adapter = opened(adapters, RemoteDict)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    OUTAGE.down = True
    fail_lookups(client, make_keys(1), 3)
    OUTAGE.down = False
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
    assert PROBE_KEY not in adapter.backend.inner.objects
    assert adapter.backend.inner.calls["contains_many"] >= 1


@pytest.mark.parametrize(
    ("backend", "circuit", "opens_after"),
    [
        (LocalDict, None, None),
        (LocalDict, CircuitConfig(enabled=True, failure_threshold=3), 3),
        (RemoteDict, None, CircuitConfig().failure_threshold),
        (RemoteDict, CircuitConfig(enabled=False), None),
    ],
    ids=["local", "local-enabled", "remote", "remote-disabled"],
)
def test_the_circuit_is_on_for_remote_backends_unless_configured(
    adapters: list[BackendAdapter],
    outage: Outage,
    backend: type[DictBackend],
    circuit: Any,
    opens_after: int | None,
) -> None:
    adapter = opened(adapters, backend, circuit=circuit)
    assert isinstance(adapter.backend, CircuitBackend) is (opens_after is not None)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    outage.down = True
    fail_lookups(client, make_keys(1), 8)
    assert adapter.stats().get("circuit_open", 0) == int(opens_after is not None)
    assert adapter.stats()["backend_errors"] == (opens_after or 8)


def hung_after_a_store(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend], lookups: int
) -> tuple[BackendAdapter, BlockingAdapterClient, list[ObjectKey]]:
    """A key stored, then the backend hangs and ``lookups`` lookups of it time out: the
    circuit (opening after that many failures, calls timed out after 50 ms) is open."""
    circuit = CircuitConfig(failure_threshold=lookups, probe_interval_s=0.02, call_timeout_s=0.05)
    adapter = opened(adapters, backend, circuit=circuit)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    assert store(client, keys) == [True]
    outage.hang.set()
    fail_lookups(client, keys, lookups)
    return adapter, client, keys


def found_again(adapter: BackendAdapter, client: BlockingAdapterClient, keys: list[ObjectKey]) -> None:
    assert client.lookup_and_lock(keys).found == [True] * len(keys)
    adapter.unlock(keys)


@pytest.mark.parametrize("backend", [RemoteDict, AsyncRemoteDict], ids=["plain", "coroutines"])
def test_a_lookup_not_answered_in_time_is_a_miss_and_a_failure(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend]
) -> None:
    adapter, client, keys = hung_after_a_store(adapters, outage, backend, 2)
    stats = adapter.stats()
    assert stats["circuit_call_timeouts"] == 2 and stats["circuit_open"] == 1
    # Probes time out too while the backend hangs; once it answers the circuit closes.
    wait_for(lambda: adapter.stats().get("circuit_probe_failures", 0) >= 1, "a timed-out probe")
    outage.hang.clear()
    outage.released.set()
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
    found_again(adapter, client, keys)


@pytest.mark.parametrize("backend", [RemoteDict, AsyncRemoteDict], ids=["plain", "coroutines"])
def test_calls_stuck_for_good_do_not_keep_the_circuit_open(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend]
) -> None:
    # four calls left inside the backend, which never return
    adapter, client, keys = hung_after_a_store(adapters, outage, backend, 4)
    assert adapter.stats()["circuit_open"] == 1
    outage.hang.clear()  # the backend answers new calls; the four stay stuck (for WAIT_S)
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close", within=WAIT_S / 3)
    found_again(adapter, client, keys)


_EXITS_WITH_A_CALL_STUCK = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from l2_backends import DictBackend, open_dict
from lmcache_tiers.config import CircuitConfig
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

class Hung(DictBackend):
    remote = True
    def contains_many(self, keys):
        threading.Event().wait()  # never returns

adapter = open_dict(Hung, circuit=CircuitConfig(call_timeout_s=0.05))
client = BlockingAdapterClient(adapter, timeout=30)
assert client.lookup_and_lock(make_keys(1)).found == [False]
adapter.close()
print("closed", flush=True)
"""


def test_a_call_stuck_for_good_does_not_keep_the_process_from_exiting() -> None:
    tests = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", _EXITS_WITH_A_CALL_STUCK, tests], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "closed\n", done.stderr[-2000:]


@pytest.mark.parametrize("backend", [RemoteDict, AsyncRemoteDict], ids=["plain", "coroutines"])
def test_closing_an_open_circuit_ends_its_probing(
    adapters: list[BackendAdapter],
    outage: Outage,
    backend: type[DictBackend],
    new_threads: Callable[[str], list[threading.Thread]],
) -> None:
    adapter = open_dict(backend, circuit=CircuitConfig(failure_threshold=1, probe_interval_s=0.01))
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    outage.down = True
    fail_lookups(client, make_keys(1), 1)
    wait_for(lambda: adapter.stats().get("circuit_probes", 0) >= 1, "a probe")
    adapter.close()
    probes = adapter.stats().get("circuit_probes", 0)
    time.sleep(0.1)
    assert adapter.stats().get("circuit_probes", 0) == probes
    assert not [t.name for t in new_threads("") if t.name.endswith("-probe") and "0:t" in t.name]


def test_circuit_options_are_validated_with_their_path() -> None:
    registry = ComponentRegistry()
    registry.for_plugin(Kind.L2_ADAPTER, "test").add("dict", DictBackend, DictConfig)
    spec = decode_adapter(registry, {"type": "dict", "circuit": {"failure_threshold": 2}}, 0)
    assert spec.config.circuit == CircuitConfig(failure_threshold=2)
    for bad in ({"failure_threshold": 0}, {"probe_interval_s": 0}, {"call_timeout_s": -1}, {"x": 1}):
        with pytest.raises(ConfigError, match=r"\$\.l2_adapters\[1\]\.circuit"):
            decode_adapter(registry, {"type": "dict", "circuit": bad}, 1)
    assert msgspec.convert({}, CircuitConfig).enabled is None


class SlowToCancel(AsyncRemoteDict):
    """A store whose lookups, once cancelled, take long to clean up (a reconnect to a host
    that no longer answers), until ``OUTAGE.released``."""

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:  # type: ignore[override]
        try:
            return await super().contains_many(keys)
        except asyncio.CancelledError:
            while not OUTAGE.released.is_set():
                await asyncio.sleep(0.01)
            raise


def test_a_lookup_given_up_at_its_timeout_does_not_wait_for_the_call_to_wind_down(
    adapters: list[BackendAdapter], outage: Outage
) -> None:
    circuit = CircuitConfig(failure_threshold=100, call_timeout_s=0.05)
    adapter = opened(adapters, SlowToCancel, circuit=circuit)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    assert store(client, keys) == [True]
    outage.hang.set()
    try:
        started = time.monotonic()
        assert client.lookup_and_lock(keys, timeout=5.0).found == [False]
        assert time.monotonic() - started < 5.0
        assert adapter.stats()["circuit_call_timeouts"] == 1
    finally:
        outage.released.set()


class LeftCall:
    """What a call given up at its timeout is doing while it winds down."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: weakref.ref[asyncio.Future[None]] | None = None
        self.ended = threading.Event()


LEFT = LeftCall()


class WindsDownOnItsOwnFuture(AsyncRemoteDict):
    """A store whose lookups, once cancelled, wait on a wake-up that only the call holds
    (a client library's own future, woken by a callback of its connection)."""

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:  # type: ignore[override]
        try:
            return await super().contains_many(keys)
        except asyncio.CancelledError:
            loop = asyncio.get_running_loop()
            wake: asyncio.Future[None] = loop.create_future()
            LEFT.loop, LEFT.wake = loop, weakref.ref(wake)
            try:
                await wake
            finally:
                LEFT.ended.set()
            raise


def test_a_lookup_given_up_at_its_timeout_is_not_destroyed_while_it_winds_down(
    adapters: list[BackendAdapter], outage: Outage
) -> None:
    # The event loop holds its tasks weakly: a given-up call nobody kept could be garbage
    # collected mid-flight, its cleanup cut short by a GeneratorExit.
    global LEFT
    LEFT = LeftCall()
    circuit = CircuitConfig(failure_threshold=100, call_timeout_s=0.05)
    adapter = opened(adapters, WindsDownOnItsOwnFuture, circuit=circuit)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    assert store(client, keys) == [True]
    outage.hang.set()
    assert client.lookup_and_lock(keys, timeout=5.0).found == [False]
    wait_for(lambda: LEFT.wake is not None, "the left call to wait for its wake-up")
    gc.collect()
    assert not LEFT.ended.is_set(), "the left call was destroyed before it ended"
    wake = LEFT.wake()
    assert wake is not None and LEFT.loop is not None
    LEFT.loop.call_soon_threadsafe(wake.set_result, None)
    del wake
    assert LEFT.ended.wait(WAIT_S)


class CancelledOnce:
    """A ``ping`` whose first answer is a ``CancelledError`` of the client library's own (a
    plain method running coroutines, or a coroutine whose request the library cancelled):
    a failed probe, after which the backend answers."""

    def __init__(self) -> None:
        self.raised = False

    def check(self) -> None:
        OUTAGE.pings += 1
        if not self.raised:
            self.raised = True
            raise asyncio.CancelledError
        OUTAGE.check()


CANCELLED_ONCE = CancelledOnce()


class CancellingPingDict(RemoteDict):
    def ping(self) -> None:
        CANCELLED_ONCE.check()


class AsyncCancellingPingDict(AsyncRemoteDict):
    async def ping(self) -> None:
        await asyncio.sleep(0)
        CANCELLED_ONCE.check()


@pytest.mark.parametrize(
    "backend", [CancellingPingDict, AsyncCancellingPingDict], ids=["plain", "coroutines"]
)
def test_a_probe_raising_cancelled_error_is_a_failed_probe_and_probing_goes_on(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend]
) -> None:
    global CANCELLED_ONCE
    CANCELLED_ONCE = CancelledOnce()
    adapter = opened(adapters, backend)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    assert store(client, keys) == [True]
    outage.down = True
    fail_lookups(client, keys, 3)
    assert adapter.stats()["circuit_open"] == 1
    outage.down = False
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close", within=5.0)
    stats = adapter.stats()
    assert stats["circuit_probe_failures"] >= 1 and outage.pings >= 2
    found_again(adapter, client, keys)


@pytest.mark.parametrize("operation", ["lookup", "store", "load"])
@pytest.mark.parametrize("backend", [RemoteDict, AsyncRemoteDict], ids=["plain", "coroutines"])
def test_a_backends_own_cancelled_error_is_a_failed_call(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend], operation: str
) -> None:
    """A client library that cancels its own request raises CancelledError (no Exception)
    out of the call; nobody cancelled the adapter's task: a failed call, which counts
    toward opening the circuit like any other."""
    adapter = opened(adapters, backend)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    assert store(client, keys) == [True]
    outage.cancelled = True
    for _ in range(3):
        if operation == "lookup":
            assert client.lookup_and_lock(keys).found == [False]
        elif operation == "store":
            assert store(client, keys) == [False]
        else:
            assert client.load(keys, [memoryview(bytearray(100))]) == [False]
    stats = adapter.stats()
    assert stats["backend_errors"] == 3
    assert stats["circuit_failures"] == 3 and stats["circuit_open"] == 1
    outage.cancelled = False
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
    found_again(adapter, client, keys)


class HungStore(AsyncRemoteDict):
    """Stores that hang until ``OUTAGE.released``; ``OUTAGE.hang`` is set once one began."""

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        OUTAGE.hang.set()
        await asyncio.sleep(WAIT_S)
        return await super().put_many(keys, payloads)


def test_a_call_cancelled_by_close_is_not_a_failed_call(
    adapters: list[BackendAdapter], outage: Outage
) -> None:
    adapter = opened(adapters, HungStore)
    adapter.submit_store(make_keys(1), [memoryview(bytearray(100))])
    wait_for(outage.hang.is_set, "the store to reach the backend")
    adapter.close_timeout_s = 0.05  # type: ignore[misc]
    adapter.close()
    stats = adapter.stats()
    assert stats.get("backend_errors", 0) == 0 and stats.get("circuit_failures", 0) == 0


class StuckCalls:
    """Lookups inside the backend: how many now, the most at once, how many began."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.began = 0

    def enter(self) -> None:
        self.began += 1
        self.now += 1
        self.most = max(self.most, self.now)

    def leave(self) -> None:
        self.now -= 1


STUCK = StuckCalls()


class IgnoresCancellation(AsyncRemoteDict):
    """Lookups that, while ``OUTAGE.hang`` is set, swallow every cancellation and end only
    at ``OUTAGE.released`` (a client library that never honours it)."""

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:  # type: ignore[override]
        if not OUTAGE.hang.is_set():
            return await super().contains_many(keys)
        STUCK.enter()
        try:
            while not OUTAGE.released.is_set():
                try:
                    await asyncio.sleep(0.005)
                except asyncio.CancelledError:
                    pass
        finally:
            STUCK.leave()
        return await super().contains_many(keys)


class HangsOnItsThread(RemoteDict):
    """Lookups that, while ``OUTAGE.hang`` is set, block their thread until ``OUTAGE.released``."""

    lock = threading.Lock()

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        if not OUTAGE.hang.is_set():
            return super().contains_many(keys)
        with self.lock:
            STUCK.enter()
        try:
            OUTAGE.released.wait(WAIT_S)
        finally:
            with self.lock:
                STUCK.leave()
        return super().contains_many(keys)


@pytest.mark.parametrize("backend", [HangsOnItsThread, IgnoresCancellation], ids=["plain", "coroutines"])
def test_calls_left_at_their_timeout_are_capped(
    adapters: list[BackendAdapter], outage: Outage, backend: type[DictBackend]
) -> None:
    """Calls given up at their timeout that never end hold at most ``TIMED_HELPERS`` slots;
    a call past that never reaches the backend and fails at its timeout."""
    global STUCK
    STUCK = StuckCalls()
    circuit = CircuitConfig(failure_threshold=1000, call_timeout_s=0.02)
    adapter = opened(adapters, backend, circuit=circuit)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    assert store(client, keys) == [True]
    outage.hang.set()
    lookups = TIMED_HELPERS + 16  # some to spare: a call not started at its timeout never runs
    fail_lookups(client, keys, lookups)
    assert adapter.stats()["circuit_call_timeouts"] == lookups
    assert STUCK.began == TIMED_HELPERS and STUCK.most == TIMED_HELPERS
    outage.hang.clear()
    outage.released.set()
    wait_for(lambda: STUCK.now == 0, "the left calls to end")
    found_again(adapter, client, keys)


class HalfDict(RemoteDict):
    """A store of two nodes, one of which does not answer: stores and deletes do the first
    half of their keys and raise ``PartialFailure`` for the rest."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        half = len(keys) // 2
        done = super().put_many(keys[:half], payloads[:half])
        raise PartialFailure([*done, *[False] * (len(keys) - half)], "node 2 did not answer")

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        half = len(keys) // 2
        done = super().delete_many(keys[:half])
        raise PartialFailure([*done, *[False] * (len(keys) - half)], "node 2 did not answer")


class AsyncHalfDict(AsyncRemoteDict):
    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        half = len(keys) // 2
        done = await super().put_many(keys[:half], payloads[:half])
        raise PartialFailure([*done, *[False] * (len(keys) - half)], "node 2 did not answer")

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:  # type: ignore[override]
        half = len(keys) // 2
        done = await super().delete_many(keys[:half])
        raise PartialFailure([*done, *[False] * (len(keys) - half)], "node 2 did not answer")


@pytest.mark.parametrize("backend", [HalfDict, AsyncHalfDict], ids=["plain", "coroutines"])
def test_a_call_that_failed_part_way_reports_its_keys_and_counts_as_failed(
    adapters: list[BackendAdapter], backend: type[DictBackend]
) -> None:
    """``PartialFailure``: the keys done are accounted as done (stored, removed), and the
    call is a failure the circuit breaker counts -- returning the same answer would leave
    the breaker blind to a node that never answers."""
    adapter = opened(adapters, backend, circuit=CircuitConfig(failure_threshold=3, probe_interval_s=60))
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(4)
    assert store(client, keys) == [True, True, False, False]
    assert adapter.used_bytes() == 200, "the two keys stored are accounted"
    stats = adapter.stats()
    assert stats["backend_errors"] == 1 and stats["circuit_failures"] == 1
    assert adapter.delete(keys[:2]) == [True, False]
    assert adapter.used_bytes() == 100
    assert adapter.stats()["circuit_failures"] == 2
    # (The delete's absence check of the key not removed answered: a success, which
    # resets the count of consecutive failures.)
    for start in (10, 20, 30):
        assert store(client, make_keys(2, start=start)) == [True, False]
    assert adapter.stats()["circuit_open"] == 1, "three calls in a row failed part-way: the circuit opens"
    assert store(client, make_keys(2, start=40)) == [False, False]
    assert adapter.stats()["circuit_skipped_store_keys"] == 2


@pytest.mark.parametrize("results", [[True], "yes", None], ids=["short", "string", "none"])
def test_a_partial_failure_whose_results_cannot_be_trusted_fails_the_batch(
    adapters: list[BackendAdapter], results: Any
) -> None:
    class Lying(RemoteDict):
        def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
            super().put_many(keys, payloads)
            raise PartialFailure(results, "node 2 did not answer")

    adapter = opened(adapters, Lying)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    assert store(client, make_keys(2)) == [False, False]
    assert adapter.stats()["backend_errors"] == 1


class HalfLookups(RemoteDict):
    """Lookups of a store of two nodes, one of which does not answer: the first half of the
    keys is answered, the rest ``None`` -- not known absent, only not answered."""

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        half = len(keys) // 2
        found = super().contains_many(keys[:half])
        raise PartialFailure([*found, *[None] * (len(keys) - half)], "node 2 did not answer")


def test_a_lookup_that_failed_part_way_forgets_no_accounted_key(adapters: list[BackendAdapter]) -> None:
    """A lookup's None says "absent": from a ``PartialFailure`` it may only be a key the
    failed node never answered for, and taking it so would release the bytes of an object
    still stored (usage too low, listeners told it is gone).  The lookup fails instead."""
    adapter = opened(adapters, HalfLookups, circuit=CircuitConfig(failure_threshold=3, probe_interval_s=60))
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(2)
    assert store(client, keys) == [True, True]
    assert adapter.used_bytes() == 200
    assert client.lookup_and_lock(keys).found == [False, False]
    assert adapter.used_bytes() == 200, "the key the failed node did not answer for is still accounted"
    stats = adapter.stats()
    assert stats["backend_errors"] == 1 and stats["circuit_failures"] == 1
    assert stats.get("objects_vanished", 0) == 0


class AnsweredJustAfterTheWait:
    """A timed call's future whose answer arrives right after the wait for it gave up: the
    wait's TimeoutError is raised once the call has finished."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            self.future.result(WAIT_S)  # the answer arrives ...
            raise TimeoutError  # ... just after the wait's own timeout
        return self.future.result()

    def done(self) -> bool:
        return bool(self.future.done())

    def cancel(self) -> bool:
        return bool(self.future.cancel())


def test_a_lookup_answered_right_after_its_wait_timed_out_keeps_its_answer(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer is there by the time the timeout is handled: it is the lookup's answer,
    not a failed call (nor a timeout) that would make the key a miss."""
    adapter = opened(adapters, RemoteDict, circuit=CircuitConfig(failure_threshold=100, call_timeout_s=0.05))
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    assert store(client, keys) == [True]
    circuit = adapter.backend
    assert isinstance(circuit, CircuitBackend) and circuit._helpers is not None
    submit = circuit._helpers.submit
    monkeypatch.setattr(circuit._helpers, "submit", lambda call: AnsweredJustAfterTheWait(submit(call)))
    found_again(adapter, client, keys)
    stats = adapter.stats()
    assert stats.get("circuit_call_timeouts", 0) == 0
    assert stats.get("backend_errors", 0) == 0


#: a thread stack no system can map (beyond any address space, so even with memory
#: overcommit unlimited): ``Thread.start`` then fails as it does when the process has no
#: threads left ("can't start new thread")
UNMAPPABLE_STACK = 2**62


def test_a_probe_thread_that_cannot_start_is_counted_and_started_again_by_a_refused_call(
    adapters: list[BackendAdapter], outage: Outage, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = opened(adapters, RemoteDict)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    outage.down = True
    fail_lookups(client, keys, 2)
    previous = threading.stack_size(UNMAPPABLE_STACK)
    try:
        # The third failure opens the circuit, whose probe thread cannot start.
        fail_lookups(client, keys, 1)
    finally:
        threading.stack_size(previous)
    stats = adapter.stats()
    assert stats["circuit_open"] == 1
    assert stats["circuit_probe_start_failures"] == 1
    assert stats["backend_errors"] == 3, "the backend's own error, not the thread's, failed the call"
    assert "probe thread could not start" in caplog.text

    # The backend answers again: the next refused call starts the probing, which closes it.
    outage.down = False
    assert client.lookup_and_lock(keys).found == [False]
    assert adapter.stats()["circuit_missed_lookup_keys"] == 1
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
    assert store(client, keys) == [True]


def test_a_call_refused_once_the_adapter_closes_starts_no_probe_thread(
    adapters: list[BackendAdapter], outage: Outage
) -> None:
    # Closing ends the probing with the circuit open; a call refused then (one still in the
    # adapter's queue at its close) must not start a thread that can only end at once.
    adapter = opened(adapters, RemoteDict)
    client = BlockingAdapterClient(adapter, timeout=WAIT_S)
    keys = make_keys(1)
    outage.down = True
    fail_lookups(client, keys, 3)
    circuit = adapter.backend
    assert isinstance(circuit, CircuitBackend)
    probing = circuit._probe_thread
    assert probing is not None
    adapter.close()
    assert not probing.is_alive()

    with pytest.raises(NotCalled):
        circuit.contains_many(keys)
    assert circuit._probe_thread is probing


def test_failures_that_open_the_circuit_once_the_adapter_closes_start_no_probe_thread(
    adapters: list[BackendAdapter], outage: Outage
) -> None:
    # Calls still running at the close may fail (the store going away with the server) and
    # open the circuit then: probing cannot close it any more, and a thread started for it
    # would end at once.
    adapter = opened(adapters, RemoteDict)
    circuit = adapter.backend
    assert isinstance(circuit, CircuitBackend)
    adapter.close()
    outage.down = True
    for _ in range(3):
        with pytest.raises(ConnectionError):
            circuit.contains_many(make_keys(1))
    assert adapter.stats()["circuit_open"] == 1
    assert circuit._probe_thread is None
