"""Helpers of backends that move batches: objects shared out over threads (BatchWorkers),
and reader counts that keep a slot from being reused under a load (SlotReaders)."""

from __future__ import annotations

import threading
import time

import pytest

from lmcache_tiers.l2.readers import SlotReaders
from lmcache_tiers.l2.workers import BatchWorkers


@pytest.fixture
def workers():
    pool = BatchWorkers(3, "test-batch")
    yield pool
    pool.shutdown()


def test_results_come_back_in_row_order(workers: BatchWorkers) -> None:
    rows = list(range(20))
    expected = [a * 10 + b for a, b in zip(rows, rows[::-1], strict=True)]
    assert workers.map(lambda a, b: a * 10 + b, rows, rows[::-1]) == expected
    assert workers.map(lambda a: a, []) == []


def test_rows_are_shared_out_over_the_threads_the_caller_included(workers: BatchWorkers) -> None:
    seen: dict[int, str] = {}
    barrier = threading.Barrier(3, timeout=10)
    in_barrier = threading.local()

    def work(row: int) -> int:
        if not getattr(in_barrier, "done", False):
            in_barrier.done = True
            barrier.wait()  # each of the three threads takes a row before any takes two
        seen[row] = threading.current_thread().name
        return row

    assert workers.map(work, range(9)) == list(range(9))
    assert sorted(seen) == list(range(9))  # every row once
    assert len(set(seen.values())) == 3
    assert threading.current_thread().name in seen.values()


def test_a_slow_thread_takes_fewer_rows(workers: BatchWorkers) -> None:
    """Rows are taken one at a time: a thread held up does fewer, the batch is not held up
    by a fixed share."""
    me = threading.current_thread().name
    by_thread: dict[str, int] = {}
    lock = threading.Lock()

    def work(row: int) -> int:
        name = threading.current_thread().name
        with lock:
            by_thread[name] = by_thread.get(name, 0) + 1
        if name == me:
            time.sleep(0.2)  # the caller is slow
        return row

    assert workers.map(work, range(30)) == list(range(30))
    assert sum(by_thread.values()) == 30
    assert by_thread.get(me, 0) < 10  # fewer than a fixed third: the others took the rest


def test_parallel_false_and_single_rows_run_on_the_caller(workers: BatchWorkers) -> None:
    me = threading.current_thread().name
    assert workers.map(lambda _r: threading.current_thread().name, range(5), parallel=False) == [me] * 5
    assert workers.map(lambda _r: threading.current_thread().name, [0]) == [me]
    single = BatchWorkers(1, "test-single")
    assert single.map(lambda _r: threading.current_thread().name, range(4)) == [me] * 4
    single.shutdown()


def test_every_row_is_worked_when_one_raises_then_the_first_error_is_raised(workers: BatchWorkers) -> None:
    done: list[int] = []
    lock = threading.Lock()

    def work(row: int) -> int:
        if row in (4, 7):
            time.sleep(0.01 * (row == 4))
            raise ValueError(f"row {row}")
        with lock:
            done.append(row)
        return row

    with pytest.raises(ValueError, match="row"):
        workers.map(work, range(12))
    assert sorted(done) == [row for row in range(12) if row not in (4, 7)]


def test_slot_readers_free_a_retired_slot_when_its_last_reader_leaves() -> None:
    readers = SlotReaders()
    assert readers.retire(1)  # nobody reads it: free now
    readers.acquire(2)
    readers.acquire(2)
    assert readers.reading(2) and not readers.reading(1)
    assert not readers.retire(2)  # read: it waits
    assert readers.retired == frozenset({2})
    assert not readers.release(2)  # one reader left
    assert readers.release(2)  # the last one: the caller frees it now
    assert not readers.reading(2) and readers.retired == frozenset()


def test_slot_readers_leave_a_live_slot_alone() -> None:
    readers = SlotReaders()
    readers.acquire(5)
    assert not readers.release(5)  # not retired: nothing to free
    assert not readers.reading(5)
    with pytest.raises(KeyError):
        readers.release(5)  # more releases than acquires is a bug of the caller
