"""A commit wakes the store controller once it has let go of the L1 lock: woken under
it, the controller's first step (locking the committed objects for their stores) would
wait for the committer at once, costing both a pair of thread switches per commit."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine_support import GatedStorePolicy, keys_of, mock, payload

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Object
from lmcache_tiers.storage import StorageManager

SIZE = 4096


def held_by_another_thread(lock: threading.RLock) -> bool:
    """Whether a thread other than one started here holds ``lock`` now."""
    taken: list[bool] = []

    def try_lock() -> None:
        got = lock.acquire(blocking=False)
        if got:
            lock.release()
        taken.append(got)

    probe = threading.Thread(target=try_lock)
    probe.start()
    probe.join()
    return not taken[0]


def spy_on_wake(storage: StorageManager) -> list[bool]:
    """Record, at each wake of the store controller, whether the L1 lock was held."""
    held: list[bool] = []
    wake = storage.store.wake

    def recording_wake() -> None:
        held.append(held_by_another_thread(storage.l1.lock))
        wake()

    storage.store.wake = recording_wake  # type: ignore[method-assign]
    return held


def written(storage: StorageManager, keys: list[ObjectKey]) -> dict[ObjectKey, L1Object]:
    """``keys`` reserved and their bytes copied in, not committed yet."""
    reserved = storage.reserve_write(keys, [SIZE] * len(keys))
    for key, obj in reserved.items():
        storage.view(obj)[:] = payload(key, SIZE)
    return reserved


def test_commit_reserved_wakes_the_store_controller_outside_the_l1_lock(
    engine: Callable[..., StorageManager],
) -> None:
    storage = engine([mock()])
    held = spy_on_wake(storage)
    keys = keys_of(1, 4)
    assert storage.commit_reserved(written(storage, keys)) == keys
    assert held == [False]
    assert storage.flush(10)
    assert storage.status()["failures"] == {}


def test_commit_write_wakes_the_store_controller_outside_the_l1_lock(
    engine: Callable[..., StorageManager],
) -> None:
    storage = engine([mock()])
    held = spy_on_wake(storage)
    keys = keys_of(2, 4)
    written(storage, keys)
    assert storage.commit_write(keys) == [True] * len(keys)
    assert held == [False]
    assert storage.flush(10)


def test_an_l1_only_commit_does_not_wake_the_store_controller(engine: Callable[..., StorageManager]) -> None:
    storage = engine([mock()])
    held = spy_on_wake(storage)
    reserved = storage.reserve_write(keys_of(3, 2), [SIZE, SIZE])
    assert len(storage.commit_reserved(reserved, to_l2=False)) == 2
    assert held == []


def commit(storage: StorageManager, prompt: int) -> list[ObjectKey]:
    return storage.commit_reserved(written(storage, keys_of(prompt, 2)))


def test_a_commit_behind_a_queued_batch_does_not_wake_the_store_controller_again(
    engine: Callable[..., StorageManager],
) -> None:
    storage = engine([mock()], l2_store_policy="gated")
    GatedStorePolicy.gate.clear()  # the controller parks in the policy on the first batch
    held = spy_on_wake(storage)
    assert len(commit(storage, 1)) == 2
    assert GatedStorePolicy.entered.acquire(timeout=10)  # batch 1 taken off the queue
    assert len(commit(storage, 2)) == 2  # queued alone: a wake-up is due
    assert len(commit(storage, 3)) == 2  # behind batch 2: its wake-up serves both
    assert held == [False, False]
    GatedStorePolicy.gate.set()
    assert storage.flush(10)
    assert storage.status()["failures"] == {}
    assert storage.l1.unstored() == [], "every batch was stored"
