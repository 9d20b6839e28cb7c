"""L2 eviction over victims ``delete`` refuses: pinned ones are skipped at no cost, and a
backend that deletes nothing ends the cycle early instead of being asked about every key."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from l2_backends import DictBackend, Fifo, join_left_running, open_dict

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers import base
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import DELETE_BATCH, L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

SIZE = 1000
OBJECTS = 1000


class Undeletable(DictBackend):
    """A store whose deletes all fail (down, or denied), while its objects stay there."""

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._called("delete_many")
        return [False] * len(keys)


def full_adapter(adapters: list[BackendAdapter], backend: type[DictBackend]) -> BackendAdapter:
    adapter = open_dict(backend, capacity=OBJECTS * SIZE)
    adapters.append(adapter)
    return adapter


def evicting(adapter: BackendAdapter) -> L2EvictionController:
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    controller = L2EvictionController(AdapterSlot(0, "dict", adapter), Fifo(), config, EngineStats(1))
    controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
    return controller


def fill(adapter: BackendAdapter) -> list[ObjectKey]:
    keys = make_keys(OBJECTS)
    client = BlockingAdapterClient(adapter)
    for start in range(0, OBJECTS, 250):
        batch = keys[start : start + 250]
        assert client.store(batch, [memoryview(bytearray(SIZE)) for _ in batch]) == [True] * len(batch)
    return keys


def test_a_backend_that_deletes_nothing_ends_the_cycle_early(adapters: list[BackendAdapter]) -> None:
    adapter = full_adapter(adapters, Undeletable)
    controller = evicting(adapter)
    fill(adapter)
    backend = adapter.backend
    assert isinstance(backend, Undeletable)

    controller.step(set())

    # One delete (and one check of the key's absence) per stored key, each cycle, would
    # hammer a store that is down; the cycle ends after a run of failed deletes instead.
    assert backend.calls["delete_many"] <= DELETE_BATCH
    assert adapter.used_bytes() == OBJECTS * SIZE, "nothing was deleted: all of it is still accounted"
    failures = controller.stats.failures()
    assert failures["l2_eviction_delete_failed"] == backend.calls["delete_many"], (
        "every failed delete counted"
    )


def test_a_backend_that_deletes_nothing_is_asked_again_only_on_the_next_interval(
    adapters: list[BackendAdapter],
) -> None:
    adapter = full_adapter(adapters, Undeletable)
    controller = evicting(adapter)
    controller.interval_s = 3600.0  # no cycle comes by the clock during the test
    fill(adapter)
    backend = adapter.backend
    assert isinstance(backend, Undeletable)
    controller.start()
    try:
        assert controller.wait_idle(30)
        asked = backend.calls["delete_many"]  # a cycle or two: at start, and wait_idle's
        assert asked > 0
        # Nothing is stored and nothing woke the controller: a delete's return must not
        # start another cycle (before, each did, and an idle server retried ~900 refused
        # deletes a second).  A short quiet spell shows it.
        time.sleep(0.5)
        assert backend.calls["delete_many"] == asked, "a refused delete started another cycle at once"
    finally:
        controller.stop(0.0)


def test_a_long_run_of_pinned_victims_is_skipped_and_eviction_goes_on(adapters: list[BackendAdapter]) -> None:
    adapter = full_adapter(adapters, DictBackend)
    controller = evicting(adapter)
    keys = fill(adapter)
    pinned = keys[: 3 * DELETE_BATCH]  # the oldest: the first victims, pinned by a prefetch
    assert BlockingAdapterClient(adapter).lookup_and_lock(pinned).found == [True] * len(pinned)

    controller.step(set())

    assert adapter.used_bytes() <= 0.8 * OBJECTS * SIZE, "eviction went past the pinned victims"
    stored = set(backend_keys(adapter))
    assert set(pinned) <= stored, "a pinned key was deleted"
    assert "l2_eviction_delete_failed" not in controller.stats.failures(), "a pin is not a failure"
    adapter.unlock(pinned)


class GatedPuts(DictBackend):
    """A dict whose stores wait at ``gate`` (open by default) once in the backend call."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self.entered.set()
        assert self.gate.wait(30)
        return super().put_many(keys, payloads)


@pytest.mark.parametrize("hold", ["pinned", "storing"])
def test_victims_whose_pin_or_store_ends_as_their_delete_returns_are_no_failed_deletes(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch, hold: str
) -> None:
    # The delete refuses the oldest victims for core's own reasons -- a prefetch pinned them,
    # or a store of them is in its backend call -- and that pin or store ends before the
    # cycle asks why: the backend failed nothing.
    adapter = full_adapter(adapters, GatedPuts)
    backend = adapter.backend
    assert isinstance(backend, GatedPuts)
    controller = evicting(adapter)
    keys = fill(adapter)
    held = keys[:10]
    client = BlockingAdapterClient(adapter)
    if hold == "pinned":
        assert client.lookup_and_lock(held).found == [True] * len(held)

        def let_go() -> None:
            adapter.unlock(held)

    else:
        backend.gate.clear()
        backend.entered.clear()
        task_id = adapter.submit_store(held, [memoryview(bytearray(SIZE)) for _ in held])
        assert backend.entered.wait(10)

        def let_go() -> None:
            backend.gate.set()
            assert client.wait(L2Op.STORE, task_id) == [True] * len(held)

    delete = adapter.delete
    pending = [let_go]

    def delete_then_let_go(batch: Sequence[ObjectKey]) -> list[bool]:
        deleted = delete(batch)
        if pending and set(held) & set(batch):
            pending.pop()()
        return deleted

    monkeypatch.setattr(adapter, "delete", delete_then_let_go)
    controller.step(set())

    assert not pending, "the held victims were offered"
    assert "l2_eviction_delete_failed" not in controller.stats.failures()


class Hung(DictBackend):
    """A store whose deletes hang (a remote store gone silent, no timeout of its own)
    until the test lets them go."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.entered = threading.Event()
        self.release = threading.Event()

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self.entered.set()
        self.release.wait(30)
        return super().delete_many(keys)


@pytest.fixture
def stuck_in_a_delete(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[BackendAdapter, L2EvictionController, threading.Event]]:
    """A running L2 eviction controller whose cycle is stuck in a delete, and the event
    that lets the delete go (set at teardown too)."""
    monkeypatch.setattr(base, "JOIN_GRACE_S", 0.2)
    adapter = full_adapter(adapters, Hung)
    backend = adapter.backend
    assert isinstance(backend, Hung)
    controller = evicting(adapter)
    controller.start()
    try:
        fill(adapter)
        assert backend.entered.wait(10)
        yield adapter, controller, backend.release
    finally:
        backend.release.set()


def test_a_delete_that_never_returns_does_not_hang_stopping_the_controller(
    stuck_in_a_delete: tuple[BackendAdapter, L2EvictionController, threading.Event],
) -> None:
    # Shutdown stops L2 eviction before it closes the adapters, whose close interrupts
    # stuck calls: a stop waiting for the stuck delete would wait for ever.
    _, controller, release = stuck_in_a_delete
    stopper = threading.Thread(target=controller.stop, args=(0.0,), daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive(), "stop waited for a delete that does not return"
    release.set()
    assert controller.join()  # let go, the thread ends on its own


def test_a_cycle_left_behind_at_stop_counts_no_failed_deletes_once_the_adapter_closed(
    stuck_in_a_delete: tuple[BackendAdapter, L2EvictionController, threading.Event],
) -> None:
    # The cycle stops waiting for a delete stuck at shutdown (it runs on a thread of its
    # own), and the adapter closes next; once the delete returns, nothing goes on deleting
    # through the closed adapter (which refuses every key): those are no failed deletes of
    # the backend, and a shutdown that does not wait for a delete is no delete timeout.
    adapter, controller, release = stuck_in_a_delete
    assert controller.stop(0.0), "the cycle does not wait for the stuck delete"
    adapter.close()  # as StorageParts.close does next
    release.set()
    join_left_running(controller, "delete")
    failures = controller.stats.failures()
    assert "l2_eviction_delete_failed" not in failures
    assert "l2_eviction_delete_timeout" not in failures


def backend_keys(adapter: BackendAdapter) -> list[ObjectKey]:
    backend = adapter.backend
    assert isinstance(backend, DictBackend)
    with backend.lock:
        return list(backend.objects)
