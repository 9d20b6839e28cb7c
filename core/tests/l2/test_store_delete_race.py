"""A store and a delete of the same key never overlap in one adapter.

Stores run on worker threads (or an event loop), deletes on the caller's thread: without
the write claims of ``PinTable`` a delete could remove a key while its store is inside
``put_many`` and the store would then account and announce the key the backend no longer
holds, or a store could start while a delete of the key is inside ``delete_many``.  Here
the backend's calls wait at gates (threading events), so a store or a delete is provably
in flight; nothing is timed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from l2_backends import DictBackend, DictConfig, Fifo, Xor, open_dict

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, BackendContext, L2Op, ObjectSize
from lmcache_tiers.l2.pins import Claim, PinTable
from lmcache_tiers.l2.runners import LoopRunner, ThreadRunner
from lmcache_tiers.serde import SerdeContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.l2_support import RecordingListener

#: generous: only reached when something is broken
TIMEOUT = 30.0
SIZE = 100
CAPACITY_OBJECTS = 10


class Gate:
    """Where a backend call waits until the test opens it; counts the calls that arrived."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._cond = threading.Condition()
        self._arrived = 0

    def _arrive(self) -> None:
        with self._cond:
            self._arrived += 1
            self._cond.notify_all()

    def arrived(self, count: int = 1) -> bool:
        """Wait until ``count`` calls are at the gate."""
        with self._cond:
            return self._cond.wait_for(lambda: self._arrived >= count, TIMEOUT)

    def open(self) -> None:
        self._open.set()

    def pass_(self) -> None:
        self._arrive()
        if not self._open.wait(TIMEOUT):
            raise TimeoutError("the gate was never opened")

    async def pass_async(self) -> None:
        self._arrive()
        deadline = time.monotonic() + TIMEOUT
        while not self._open.is_set():  # the loop keeps running other calls meanwhile
            if time.monotonic() > deadline:
                raise TimeoutError("the gate was never opened")
            await asyncio.sleep(0.001)


class GatedBackend(DictBackend):
    """The dict backend whose ``put_many`` publishes the objects, then waits at its gate
    (and may raise after it); whose ``delete_many`` waits at its gate before removing."""

    concurrency = 2  # two stores of the same key can be in put_many at once

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.gates: dict[str, Gate] = {}
        self.put_raises = False
        self.delete_raises = False

    def gate(self, method: str) -> Gate:
        self.gates[method] = gate = Gate()
        return gate

    def ungate(self) -> None:
        for gate in self.gates.values():
            gate.open()
        self.gates = {}

    def _put_result(self, result: list[bool]) -> list[bool]:
        if self.put_raises:
            raise OSError("injected failure in put_many (after publishing)")
        return result

    def _delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if self.delete_raises:
            raise OSError("injected failure in delete_many")
        return DictBackend.delete_many(self, keys)

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        result = super().put_many(keys, payloads)
        if (gate := self.gates.get("put_many")) is not None:
            gate.pass_()
        return self._put_result(result)

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if (gate := self.gates.get("delete_many")) is not None:
            gate.pass_()
        return self._delete(keys)


class AsyncGatedBackend(GatedBackend):
    """The same behind coroutines: a call at its gate leaves the event loop free."""

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        result = DictBackend.put_many(self, keys, payloads)
        if (gate := self.gates.get("put_many")) is not None:
            await gate.pass_async()
        return self._put_result(result)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:  # type: ignore[override]
        return DictBackend.contains_many(self, keys)

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        return DictBackend.get_many_into(self, keys, buffers)

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:  # type: ignore[override]
        if (gate := self.gates.get("delete_many")) is not None:
            await gate.pass_async()
        return self._delete(keys)


BACKENDS = pytest.mark.parametrize("backend", [GatedBackend, AsyncGatedBackend], ids=["plain", "coroutines"])


@pytest.fixture
def adapters(adapters: list[BackendAdapter]) -> Iterator[list[BackendAdapter]]:
    """The conftest's fixture, with every gate opened before the adapters close: a failing
    test never leaves a backend call waiting out its timeout."""
    yield adapters
    for adapter in adapters:
        if isinstance(adapter.backend, GatedBackend):
            adapter.backend.ungate()


def opened(adapters: list[BackendAdapter], backend: type[GatedBackend]) -> BackendAdapter:
    adapter = open_dict(backend, capacity=CAPACITY_OBJECTS * SIZE)
    adapters.append(adapter)
    return adapter


def backend_of(adapter: BackendAdapter) -> GatedBackend:
    backend = adapter.backend
    assert isinstance(backend, GatedBackend)
    return backend


def started(
    adapters: list[BackendAdapter], backend: type[GatedBackend]
) -> tuple[BackendAdapter, GatedBackend, BlockingAdapterClient]:
    """A new adapter over ``backend``, the backend itself, and a blocking client of it."""
    adapter = opened(adapters, backend)
    return adapter, backend_of(adapter), BlockingAdapterClient(adapter, timeout=TIMEOUT)


def held(backend: GatedBackend) -> set[ObjectKey]:
    with backend.lock:
        return set(backend.objects)


def buffers(count: int) -> list[memoryview]:
    return [memoryview(bytearray(SIZE)) for _ in range(count)]


def delete_in_thread(
    adapter: BackendAdapter, keys: list[ObjectKey]
) -> tuple[threading.Thread, list[list[bool]]]:
    outcome: list[list[bool]] = []
    thread = threading.Thread(target=lambda: outcome.append(adapter.delete(keys)), name="test-deleter")
    thread.start()
    return thread, outcome


def no_claims_left(adapter: BackendAdapter) -> None:
    pins = adapter.state.pins
    assert pins.writers() == {}, "a store left a write claim behind"
    assert pins.deleting() == set(), "a delete left a key claimed"
    assert pins.snapshot() == {}


# -- the pin table --------------------------------------------------------------------------------


def test_write_claims_and_delete_claims_exclude_each_other() -> None:
    a, b, c = make_keys(3)
    pins = PinTable()
    assert pins.begin_write([a, a, b]) == [True, True, True], "stores of one key may overlap"
    assert pins.claim_delete([a, b, c]) == [Claim.STORING, Claim.STORING, Claim.CLAIMED]
    assert pins.begin_write([c, b]) == [False, True], "a key being deleted is not written"
    assert pins.busy([a, b, c]) == [True, True, False]
    assert pins.end_write([a, b]) == 2
    assert pins.begin_delete([a, b]) == [False, False], "one store of a (and of b) still runs"
    assert pins.end_write([a, b, c]) == 2, "ending a claim not held is ignored"
    assert pins.begin_delete([a, b]) == [True, True]
    pins.end_delete([a, b, c])
    assert pins.writers() == {} and pins.deleting() == set()


def test_the_absence_check_after_a_delete_neither_refuses_nor_is_refused_by_stores() -> None:
    a, b = make_keys(2)
    pins = PinTable()
    assert pins.begin_write([a]) == [True]
    assert pins.begin_check([a, b]) == [True, True], "its release keeps what a store replaced"
    assert pins.begin_write([b]) == [True]
    assert pins.begin_delete([a, b]) == [False, False], "being checked"
    assert pins.pin([a, b]) == [False, False]
    pins.end_delete([a, b])
    pins.end_write([a, b])
    assert pins.writers() == {} and pins.deleting() == set()


def test_a_pinned_key_being_stored_is_refused_as_pinned() -> None:
    (a,) = make_keys(1)
    pins = PinTable()
    assert pins.pin([a]) == [True]
    assert pins.begin_write([a]) == [True], "a lookup does not keep a store off"
    assert pins.claim_delete([a, a]) == [Claim.PINNED, Claim.PINNED]
    pins.unpin([a])
    pins.end_write([a])
    assert pins.claim_delete([a, a]) == [Claim.CLAIMED, Claim.DELETING]


# -- a delete while a store of the key is in put_many ------------------------------------------------


@BACKENDS
def test_a_delete_during_the_store_of_the_key_is_refused_and_the_store_stays_accounted(
    adapters: list[BackendAdapter], backend: type[GatedBackend], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = opened(adapters, backend)
    store = backend_of(adapter)
    listener = RecordingListener()
    adapter.add_listener(listener)
    client = BlockingAdapterClient(adapter, timeout=TIMEOUT)
    (key,) = make_keys(1)
    gate = store.gate("put_many")
    task_id = adapter.submit_store([key], buffers(1))
    assert gate.arrived(), "the store never reached put_many"
    assert key in held(store), "the store published the object and is still in put_many"

    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        assert adapter.delete([key]) == [False], "a key being stored is not deleted"
    assert adapter.pinned([key]) == [True], "refused by core, not by a failing backend"
    assert key in held(store)
    stats = adapter.stats()
    assert stats["delete_skipped_storing"] == 1
    assert stats["delete_keys_skipped"] == 1
    assert stats.get("delete_keys_ok", 0) == 0
    assert any("a store of each is in flight" in record.getMessage() for record in caplog.records)

    store.ungate()
    assert client.wait(L2Op.STORE, task_id) == [True]
    assert key in held(store)
    assert adapter.used_bytes() == SIZE, "stored and accounted once"
    assert adapter.usage() == pytest.approx(1 / CAPACITY_OBJECTS)
    assert adapter.state.accounting.get(key) == ObjectSize(SIZE, SIZE)
    assert [(kind, keys) for kind, _, keys in listener.events] == [("stored", [key])]
    no_claims_left(adapter)

    # Once the store is over, the key deletes as any other.
    assert adapter.delete([key]) == [True]
    assert key not in held(store)
    assert adapter.used_bytes() == 0
    assert [(kind, keys) for kind, _, keys in listener.events] == [("stored", [key]), ("deleted", [key])]
    no_claims_left(adapter)


@BACKENDS
def test_two_stores_of_one_key_in_flight_keep_deletes_off_until_both_end(
    adapters: list[BackendAdapter], backend: type[GatedBackend]
) -> None:
    adapter, store, client = started(adapters, backend)
    (key,) = make_keys(1)
    gate = store.gate("put_many")
    first = adapter.submit_store([key], buffers(1))
    second = adapter.submit_store([key], buffers(1))
    assert gate.arrived(2), "both stores are in put_many at once"
    assert adapter.state.pins.writers() == {key: 2}
    assert adapter.delete([key]) == [False]

    store.ungate()
    assert client.wait(L2Op.STORE, first) == [True]
    assert client.wait(L2Op.STORE, second) == [True]
    assert adapter.used_bytes() == SIZE
    assert adapter.stats()["delete_skipped_storing"] == 1
    no_claims_left(adapter)
    assert adapter.delete([key]) == [True]
    assert adapter.used_bytes() == 0


@BACKENDS
def test_a_store_whose_put_many_raises_leaves_no_claim_and_deletes_work_again(
    adapters: list[BackendAdapter], backend: type[GatedBackend]
) -> None:
    adapter, store, client = started(adapters, backend)
    (key,) = make_keys(1)
    store.put_raises = True
    gate = store.gate("put_many")
    task_id = adapter.submit_store([key], buffers(1))
    assert gate.arrived()
    assert adapter.delete([key]) == [False], "in flight until put_many raised"
    store.ungate()
    assert client.wait(L2Op.STORE, task_id) == [False]
    assert adapter.stats()["backend_errors"] == 1
    assert adapter.used_bytes() == 0, "a failed store accounts nothing"
    no_claims_left(adapter)

    store.put_raises = False
    assert client.store([key], buffers(1)) == [True]
    assert adapter.delete([key]) == [True], "nothing of the failed store keeps the delete off"
    assert key not in held(store)
    assert adapter.used_bytes() == 0
    assert adapter.stats()["delete_skipped_storing"] == 1
    no_claims_left(adapter)


# -- a store while a delete of the key is in delete_many ----------------------------------------------


@BACKENDS
def test_a_store_during_the_delete_of_the_key_fails_that_key_only(
    adapters: list[BackendAdapter], backend: type[GatedBackend], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = opened(adapters, backend)
    store = backend_of(adapter)
    listener = RecordingListener()
    adapter.add_listener(listener)
    client = BlockingAdapterClient(adapter, timeout=TIMEOUT)
    doomed, other, fresh = make_keys(3)
    assert client.store([doomed, other], buffers(2)) == [True, True]
    gate = store.gate("delete_many")
    deleter, outcome = delete_in_thread(adapter, [doomed])
    assert gate.arrived(), "the delete never reached delete_many"

    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        # Finishes while the delete still waits in delete_many.
        assert client.store([doomed, fresh, other], buffers(3)) == [False, True, True]
    stats = adapter.stats()
    assert stats["store_skipped_deleting"] == 1
    assert stats.get("capacity_refusals", 0) == 0
    assert any("a delete of it is in flight" in record.getMessage() for record in caplog.records)
    assert adapter.used_bytes() == 3 * SIZE, "doomed still accounted until its delete is done"

    store.ungate()
    deleter.join(TIMEOUT)
    assert not deleter.is_alive()
    assert outcome == [[True]]
    assert held(store) == {other, fresh}
    assert adapter.used_bytes() == 2 * SIZE, "the reservation of the skipped store went too"
    assert adapter.state.accounting.get(doomed) is None
    assert [(kind, keys) for kind, _, keys in listener.events] == [
        ("stored", [doomed, other]),
        ("stored", [fresh, other]),
        ("deleted", [doomed]),
    ], "the skipped store announced nothing; the delete came last"
    no_claims_left(adapter)

    # Both over: the key stores and deletes as any other.
    assert client.store([doomed], buffers(1)) == [True]
    assert adapter.delete([doomed]) == [True]
    assert adapter.used_bytes() == 2 * SIZE
    assert [(kind, keys) for kind, _, keys in listener.events][3:] == [
        ("stored", [doomed]),
        ("deleted", [doomed]),
    ]
    no_claims_left(adapter)


@BACKENDS
def test_a_store_during_a_failing_delete_of_the_key_is_skipped_and_later_stores_work(
    adapters: list[BackendAdapter], backend: type[GatedBackend]
) -> None:
    adapter, store, client = started(adapters, backend)
    (key,) = make_keys(1)
    assert client.store([key], buffers(1)) == [True]
    store.delete_raises = True
    gate = store.gate("delete_many")
    deleter, outcome = delete_in_thread(adapter, [key])
    assert gate.arrived()
    assert client.store([key], buffers(1)) == [False]
    store.ungate()
    deleter.join(TIMEOUT)
    assert not deleter.is_alive()
    assert outcome == [[False]], "the delete failed"
    assert key in held(store) and adapter.used_bytes() == SIZE, "still there, still accounted"
    no_claims_left(adapter)

    store.delete_raises = False
    assert client.store([key], buffers(1)) == [True]
    assert adapter.used_bytes() == SIZE
    assert adapter.stats()["store_skipped_deleting"] == 1
    assert adapter.delete([key]) == [True]
    assert adapter.used_bytes() == 0
    no_claims_left(adapter)


@BACKENDS
def test_a_store_skipped_for_a_delete_gives_its_staging_buffer_back(
    adapters: list[BackendAdapter], backend: type[GatedBackend]
) -> None:
    adapter = open_dict(backend, serde=[Xor()], capacity=CAPACITY_OBJECTS * SIZE)
    adapters.append(adapter)
    store = backend_of(adapter)
    client = BlockingAdapterClient(adapter, timeout=TIMEOUT)
    (key,) = make_keys(1)
    assert client.store([key], buffers(1)) == [True]
    pool = adapter.state.chain.pool
    free_before = sum(len(blocks) for blocks in pool._free.values())
    assert free_before >= 1, "the first store's staging buffer is kept for reuse"
    gate = store.gate("delete_many")
    deleter, outcome = delete_in_thread(adapter, [key])
    assert gate.arrived()

    assert client.store([key], buffers(1)) == [False]

    assert sum(len(blocks) for blocks in pool._free.values()) == free_before, "taken and given back"
    assert adapter.stats()["store_skipped_deleting"] == 1
    store.ungate()
    deleter.join(TIMEOUT)
    assert outcome == [[True]]
    assert adapter.used_bytes() == 0
    no_claims_left(adapter)


# -- close and eviction ---------------------------------------------------------------------------------


@BACKENDS
def test_closing_with_a_store_stuck_in_put_many_leaves_no_write_claim(
    adapters: list[BackendAdapter], backend: type[GatedBackend]
) -> None:
    adapter = opened(adapters, backend)
    adapter.close_timeout_s = 0.2
    store = backend_of(adapter)
    gate = store.gate("put_many")
    task_id = adapter.submit_store(make_keys(1), buffers(1))
    assert gate.arrived()
    adapter.close()  # the plain backend's call outlives the deadline, the coroutine is cancelled
    assert adapter.pop_completed_stores() == {task_id: [False]}
    store.ungate()
    if isinstance(adapter.runner, ThreadRunner):
        for worker in adapter.runner.threads():
            worker.join(TIMEOUT)
    no_claims_left(adapter)


class GatedXor(Xor):
    """A serde whose encode waits at a gate: a store is provably inside ``prepare``."""

    def __init__(self) -> None:
        self.gate = Gate()

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        self.gate.pass_()
        return super().encode(data, context)


def test_closing_while_a_store_is_still_encoding_leaves_nothing_held(adapters: list[BackendAdapter]) -> None:
    """On an event loop a serde chain's encode runs in the executor, and cancelling the
    store's task (close) does not stop it: the encode finishes later and goes on to claim
    the key and reserve capacity for a call never made.  That is undone when it ends."""
    serde = GatedXor()
    adapter = open_dict(AsyncGatedBackend, serde=[serde], capacity=CAPACITY_OBJECTS * SIZE)
    adapter.close_timeout_s = 0.2
    # The loop's thread cannot end while the encode holds its executor: close waits the
    # whole backend-close budget for it, which is no part of what is checked here.
    adapter.close_backend_timeout_s = 0.2
    task_id = adapter.submit_store(make_keys(1), buffers(1))
    assert serde.gate.arrived()
    adapter.close()  # cancels the task awaiting the encode
    assert adapter.pop_completed_stores() == {task_id: [False]}
    serde.gate.open()
    # The loop's thread ends once its executor has shut down, after the encode returned.
    runner = adapter.runner
    assert isinstance(runner, LoopRunner)
    runner._thread.join(TIMEOUT)
    assert not runner._thread.is_alive()
    state = adapter.state
    no_claims_left(adapter)
    assert state.accounting._reserved_bytes == 0, "the abandoned store's capacity is given back"
    assert state.storing(make_keys(1)[0]) is None
    assert held(backend_of(adapter)) == set(), "the backend was never called"


def test_an_eviction_victim_being_stored_is_skipped_not_counted_as_failed(
    adapters: list[BackendAdapter],
) -> None:
    adapter = opened(adapters, GatedBackend)
    store = backend_of(adapter)
    client = BlockingAdapterClient(adapter, timeout=TIMEOUT)
    keys = make_keys(CAPACITY_OBJECTS - 1)
    config = L2EvictionConfig(trigger_watermark=0.5, eviction_ratio=0.5)
    controller = L2EvictionController(AdapterSlot(0, "gated", adapter), Fifo(), config, EngineStats(1))
    controller.evict(0)  # seeds the policy (nothing stored yet)
    assert client.store(keys, buffers(len(keys))) == [True] * len(keys)
    oldest = keys[0]
    gate = store.gate("put_many")
    task_id = adapter.submit_store([oldest], buffers(1))  # rewritten: the oldest victim in flight
    assert gate.arrived()

    controller.step(set())

    assert oldest in held(store), "a victim being stored was not deleted"
    assert adapter.stats()["delete_skipped_storing"] >= 1
    assert "l2_eviction_delete_failed" not in controller.stats.failures(), "a store in flight is no failure"
    store.ungate()
    assert client.wait(L2Op.STORE, task_id) == [True]
    assert adapter.state.accounting.get(oldest) is not None
    no_claims_left(adapter)
