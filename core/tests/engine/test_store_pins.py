"""An L2 store reads its objects' extents for as long as it runs: those extents never hold
another object's bytes meanwhile, however long the adapter stalls, so no key is ever
written to L2 with bytes that are not its own."""

from __future__ import annotations

import logging
import threading
import time

from engine_support import GatedConfig, GatedStorePolicy, gated_backend, keys_of, mock, payload, store

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.controllers import base
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.threads import joined

SIZE = 64 << 10


def gated() -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig())


def wait_for(condition, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def store_task_running(storage: StorageManager, index: int) -> bool:
    return storage.status()["adapters"][index]["store_tasks_submitted"] >= 1


def opened_once_counted(gate: threading.Event, storage: StorageManager, counter: str) -> threading.Thread:
    """A thread opening ``gate`` once the storage counted ``counter``: the close gave up on
    the store parked in the gate, and its adapter's close now waits for that call.  Opened
    after 10 s anyway when nothing is counted, so that the close ends and the test fails."""

    def open_when_counted() -> None:
        deadline = time.monotonic() + 10.0
        while counter not in storage.failures() and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()

    opener = threading.Thread(target=open_when_counted, daemon=True)
    opener.start()
    return opener


def test_a_stalled_store_keeps_its_lock_past_the_lock_ttl(engine) -> None:
    storage = engine([mock(), gated()])
    stalled = gated_backend(storage, 1)
    stalled.store_gate.clear()
    (a,) = keys_of(1, 1)
    (b,) = keys_of(2, 1)
    store(storage, [a], SIZE)
    # Stored in the mock adapter: settled, so evictable but for the stalled store's lock.
    wait_for(lambda: storage.status()["adapters"][0]["keys_stored"] >= 1, "the first adapter's store")
    wait_for(lambda: store_task_running(storage, 1), "the stalled store task")

    far = time.monotonic() + storage.l1.lock_ttl_s + storage.l1.lease_grace_s + 3600
    storage.l1.expire_locks(now=far)
    obj = storage.l1.get(a)
    assert obj is not None and obj.read_locks == 1, "the store's lock was reaped"
    assert storage.evict([a]) == 0
    store(storage, [b], SIZE)

    stalled.store_gate.set()
    assert storage.flush(10)
    assert stalled._data[a] == payload(a, SIZE)
    assert storage.l1.get(a) is obj and obj.read_locks == 0 and obj.storing == 0


def forced_clear_during_a_stalled_store(engine):  # type: ignore[no-untyped-def]
    """One object whose store task is parked in the gated adapter, then a forced clear
    (counting its loss, if any, is left to the running store); the storage, the stalled
    backend and the cleared object."""
    storage = engine([gated()])
    stalled = gated_backend(storage)
    stalled.store_gate.clear()
    (a,) = keys_of(1, 1)
    store(storage, [a], SIZE)
    wait_for(lambda: store_task_running(storage, 0), "the stalled store task")
    obj = storage.l1.get(a)
    assert obj is not None
    assert storage.clear(force=True) == 1
    return storage, stalled, obj


def test_an_object_cleared_by_force_during_its_store_keeps_its_extent_until_the_store_ends(
    engine, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.storage"):
        storage, stalled, obj = forced_clear_during_a_stalled_store(engine)
    # Its store is running and keeps the extent: the write still reaches L2, so the clear
    # counts no loss (a failing store would count itself as l2_store_failed).
    assert storage.status()["failures"].get("l1_cleared_before_l2_store") is None
    assert "before their L2 store" not in caplog.text
    # The lease ends, and new objects fill L1: none of them gets the store's extent.
    storage.l1.expire_locks(now=time.monotonic() + storage.l1.lock_ttl_s + storage.l1.lease_grace_s + 3600)
    others = keys_of(2, 200)
    for key in others:
        store(storage, [key], SIZE)
        new = storage.l1.get(key)
        assert new is not None and new.offset != obj.offset, "the stored object's extent was reused"
        storage.view(new)  # still readable: written and committed
    used_with_held = storage.l1.used_bytes

    stalled.store_gate.set()
    assert storage.flush(10)
    assert stalled._data[obj.key] == payload(obj.key, SIZE)
    assert obj.storing == 0 and obj.read_locks == 0
    # The store has let go: its extent is back in the allocator.
    assert storage.l1.used_bytes < used_with_held


def test_a_store_abandoned_at_shutdown_after_a_forced_clear_took_its_object_is_counted(engine) -> None:
    # The clear leaves the running store to count its object if the write does not reach
    # L2; a close whose drain gives up on that store must count it then, though the object
    # is no longer in L1.
    storage, stalled, _ = forced_clear_during_a_stalled_store(engine)
    opener = opened_once_counted(stalled.store_gate, storage, "l2_store_abandoned")
    storage.close(drain_timeout_s=0.05)
    joined(opener, "the store gate's opener")
    failures = storage.failures()
    # Counted once, by the store given up on: the clear counted nothing.
    assert failures.get("l2_store_abandoned") == 1
    assert "l1_cleared_before_l2_store" not in failures


def test_a_clear_counts_the_acknowledged_writes_it_takes_before_their_store(engine) -> None:
    storage = engine([gated()])
    stalled = gated_backend(storage)
    stalled.store_gate.clear()
    stored_first = keys_of(1, 3)
    stalled.store_gate.set()
    store(storage, stored_first, SIZE)
    assert storage.flush(10)
    stalled.store_gate.clear()
    pending = keys_of(2, 5)
    store(storage, pending, SIZE)
    wait_for(lambda: storage.status()["adapters"][0]["store_tasks_submitted"] >= 2, "the stalled store task")

    # Not forced: the stalled store's locks keep its objects; the rest go.
    assert storage.clear() == len(stored_first)
    assert "l1_cleared_before_l2_store" not in storage.status()["failures"]
    stalled.store_gate.set()
    assert storage.flush(10)
    assert set(stalled._data) == set(stored_first + pending)


def test_a_clear_counts_queued_writes_it_takes_and_the_store_skips_them(engine, caplog) -> None:
    storage = engine([mock()], l2_store_policy="gated")
    GatedStorePolicy.gate.clear()  # committed objects stay queued: unlocked and unstored
    queued = keys_of(1, 4)
    store(storage, queued, SIZE)
    assert GatedStorePolicy.entered.acquire(timeout=10)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.storage"):
        assert storage.clear() == len(queued)
    assert storage.status()["failures"]["l1_cleared_before_l2_store"] == len(queued)
    assert caplog.text.count("before their L2 store") == 1
    GatedStorePolicy.gate.set()
    assert storage.flush(10)
    assert list(storage.adapters[0].iter_keys()) == []
    assert storage.status()["store"]["skipped_gone"] == len(queued)


def test_a_store_task_whose_completion_fails_still_gives_its_objects_back(
    engine, monkeypatch, caplog
) -> None:
    storage = engine([mock()])
    settle = storage.l1.settle_unstored
    failures = iter([True])

    def settle_once_failing(objs):  # type: ignore[no-untyped-def]
        objs = list(objs)
        if objs and next(failures, False):  # the first store task's completion
            raise RuntimeError("settling failed")
        settle(objs)

    monkeypatch.setattr(storage.l1, "settle_unstored", settle_once_failing)
    keys = keys_of(1, 3)
    with caplog.at_level(logging.ERROR, logger="lmcache_tiers.controllers.store"):
        store(storage, keys, SIZE)
        wait_for(
            lambda: storage.status()["failures"].get("l2_store_complete_error") == 1, "the failed completion"
        )
    objects = [storage.l1.get(key) for key in keys]
    assert all(obj is not None and obj.storing == 0 and obj.read_locks == 0 for obj in objects)
    assert "finishing store task" in caplog.text
    assert storage.flush(10)
    assert set(keys) <= set(storage.adapters[0].iter_keys())
    # Stored in L2: as evictable as any object, not held back as L1's only copy for good.
    assert [obj.unstored for obj in storage.l1.unstored()] == []
    assert storage.evict(keys) == len(keys)
    # The next stores go through as usual.
    later = keys_of(2, 3)
    store(storage, later, SIZE)
    assert storage.flush(10)
    assert set(later) <= set(storage.adapters[0].iter_keys())


class ClearInStoreThread:
    """L1 listener: the first time the store controller locks objects for a store, a CLEAR
    by force lands (as one from another thread can, before the store copies them out)."""

    def __init__(self, storage: StorageManager) -> None:
        self.storage = storage
        self.cleared = 0

    def on_l1_keys_written(self, keys: object) -> None:
        pass

    def on_l1_keys_read(self, keys: object) -> None:
        if not self.cleared and threading.current_thread().name == "l2-store":
            self.cleared = self.storage.l1.clear(force=True)

    def on_l1_keys_deleted(self, keys: object) -> None:
        pass


def test_a_clear_by_force_as_a_store_locks_its_objects_does_not_fail_the_store(engine) -> None:
    storage = engine([mock()])
    clearing = ClearInStoreThread(storage)
    storage.l1.add_listener(clearing)
    written = keys_of(1, 3)
    store(storage, written, SIZE)
    assert storage.flush(10)
    assert clearing.cleared == len(written)
    failures = storage.status()["failures"]
    assert "l2_store_submit_error" not in failures, "the store of acknowledged writes failed"
    # Their extents were held for the store: it wrote their own bytes to L2.
    assert set(storage.adapters[0].iter_keys()) == set(written)
    assert storage.wait_prefetch(storage.submit_prefetch(written), 10) == len(written)
    for obj in storage.read(written):
        assert bytes(storage.view(obj)) == payload(obj.key, SIZE)
    storage.release(written, 2)
    assert storage.l1.lease_stats().quarantined_extents == 0


def test_a_queued_store_never_writes_a_later_object_of_its_key(engine) -> None:
    storage = engine([mock()], l2_store_policy="gated")
    GatedStorePolicy.gate.clear()  # the first write's batch stays queued
    (key,) = keys_of(1, 1)
    store(storage, [key], SIZE)
    assert GatedStorePolicy.entered.acquire(timeout=10)
    assert storage.clear() == 1  # counted as an acknowledged write lost before its store
    # The key written again, L1-only: never to be copied to L2.
    reserved = storage.reserve_write([key], [SIZE])
    storage.view(reserved[key])[:] = b"\x5a" * SIZE
    storage.commit_write([key], to_l2=False)
    later = storage.l1.get(key)
    GatedStorePolicy.gate.set()
    assert storage.flush(10)
    # The first write's store had nothing left to store: its object is gone.
    assert list(storage.adapters[0].iter_keys()) == []
    assert storage.status()["store"]["skipped_gone"] == 1
    assert storage.l1.get(key) is later and later.read_locks == 0 and not later.unstored
    assert storage.evict([key]) == 1


def test_a_forced_clear_object_of_a_running_store_counts_when_the_close_leaves_the_controller_behind(
    engine, monkeypatch, caplog
) -> None:
    """The close that goes on without a store controller stuck in a step counts what L1
    still holds unstored; an object a forced clear took while its store runs is no longer
    in L1, yet that store will never report now: it is lost and must count too."""
    monkeypatch.setattr(base, "JOIN_GRACE_S", 0.2)
    storage = engine([gated()], l2_store_policy="gated")
    stalled = gated_backend(storage)
    stalled.store_gate.clear()
    (a,) = keys_of(1, 1)
    (b,) = keys_of(2, 1)
    store(storage, [a], SIZE)
    wait_for(lambda: store_task_running(storage, 0), "the stalled store task")
    assert storage.clear(force=True) == 1  # takes ``a``, whose store is running
    assert GatedStorePolicy.entered.acquire(timeout=10)  # the policy call for ``a``
    GatedStorePolicy.gate.clear()
    store(storage, [b], SIZE)
    assert GatedStorePolicy.entered.acquire(timeout=10), "the controller is stuck in its policy"

    opener = opened_once_counted(stalled.store_gate, storage, "l2_store_abandoned")
    with caplog.at_level(logging.WARNING):
        storage.close(drain_timeout_s=0.0)
    joined(opener, "the store gate's opener")
    assert storage.store._thread.is_alive(), "left behind in its step"
    failures = storage.failures()
    assert failures.get("l2_store_abandoned") == 2, "b, still in L1, and a, taken by the clear"
    assert "l1_cleared_before_l2_store" not in failures

    GatedStorePolicy.gate.set()  # the step returns at last: nothing counts again
    storage.store._thread.join(30)
    assert not storage.store._thread.is_alive()
    assert storage.failures().get("l2_store_abandoned") == 2
