"""A clear of many objects lets other callers in between its batches, and clears exactly
the objects that were in L1 (and not being written) when it began."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object
from lmcache_tiers.l1.removal import CLEAR_BATCH, Removal

ALIGN = 4096
OBJECTS = 2 * CLEAR_BATCH + 10  # three batches
CAPACITY = (OBJECTS + 16) * ALIGN
# Only a bound on a wait for a thread that should already be done: never reached when the
# clear lets others in, so no assertion depends on it.
WAIT_S = 30.0


def key(index: int) -> ObjectKey:
    return ObjectKey("test-model", 0, index.to_bytes(8, "big"))


def keys(*indices: int) -> list[ObjectKey]:
    return [key(index) for index in indices]


def write(l1: L1Manager, indices: Sequence[int]) -> None:
    reserved = l1.reserve_write(keys(*indices), [1] * len(indices))
    assert all(l1.finish_write(list(reserved)))


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(CAPACITY, align=ALIGN, prefault=False)
    yield manager
    manager.close()


class DuringClear:
    """Runs ``work`` on another thread from the first batch a clear deletes (inside the L1
    lock, so the thread waits for it), and before each later batch -- outside the lock,
    where other callers get their turn -- notes whether that thread got through."""

    def __init__(self, l1: L1Manager, work: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> None:
        self.done = threading.Event()
        self.batches = 0
        self.done_before_batch: list[bool] = []

        def run() -> None:
            work()
            self.done.set()

        self._thread = threading.Thread(target=run)
        self._started = False
        clear_batch = Removal._clear_batch

        def watched_batch(removal: Removal, *args: Any) -> int:
            if self.batches:
                # A clear still holding the lock here would keep the thread out for good.
                self.done_before_batch.append(self.done.wait(WAIT_S))
            self.batches += 1
            return clear_batch(removal, *args)

        monkeypatch.setattr(Removal, "_clear_batch", watched_batch)
        l1.add_listener(self)

    def on_l1_keys_written(self, written: Sequence[ObjectKey]) -> None:
        pass

    def on_l1_keys_read(self, read: Sequence[ObjectKey]) -> None:
        pass

    def on_l1_keys_deleted(self, deleted: Sequence[ObjectKey]) -> None:
        if not self._started:  # the first batch
            self._started = True
            self._thread.start()

    def join(self) -> None:
        self._thread.join()


def test_a_lookup_and_a_store_are_served_between_the_batches_of_a_clear(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(l1, range(OBJECTS))
    looked_up: list[int] = []

    def lookup_and_store() -> None:
        looked_up.append(l1.prefix_hits(keys(OBJECTS - 1)))  # in the last batch: still there
        write(l1, [OBJECTS])  # stored while the clear runs

    during = DuringClear(l1, lookup_and_store, monkeypatch)
    assert l1.clear() == OBJECTS
    during.join()
    assert during.batches == 3
    assert during.done_before_batch == [True, True]  # served before the clear's second batch
    assert looked_up == [1]
    # An object stored after the clear began is newer than the clear: it stays.
    assert l1.contains(key(OBJECTS)) and l1.stats().objects == 1


def test_objects_being_written_when_a_clear_begins_stay_even_if_committed_during_it(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(l1, range(OBJECTS))
    pending = l1.reserve_write(keys(OBJECTS), [1])

    def commit_and_restore() -> None:
        assert l1.finish_write(list(pending)) == [True]
        # A key of the clear's last batch deleted and stored again: the new object stays.
        assert l1.delete(keys(OBJECTS - 1)) == [True]
        write(l1, [OBJECTS - 1])

    during = DuringClear(l1, commit_and_restore, monkeypatch)
    assert l1.clear(force=True) == OBJECTS - 1
    during.join()
    assert during.done_before_batch[0] is True
    assert [l1.contains(k) for k in keys(OBJECTS - 1, OBJECTS)] == [True, True]
    assert l1.stats().objects == 2


def test_a_clear_reports_the_unstored_objects_it_removed(l1: L1Manager) -> None:
    write(l1, range(3))
    marked = l1.mark_unstored(keys(0, 1))
    l1.settle_unstored(marked[1:])  # key 1's store is done: L2 has it
    cleared_unstored: list[L1Object] = []
    assert l1.clear(cleared_unstored=cleared_unstored) == 3
    assert cleared_unstored == marked[:1]
