"""A plain backend's tasks go, in the order they came, to the worker idle the shortest
time: a caller submitting one task after another is served by one warm thread, not by
each of ``concurrency`` threads in turn (a colder wake-up, often on the other core)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from l2_backends import DictBackend, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.handoff import Empty, HandOff, Worker
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.threads import DEADLINE_S

WORKERS = 4


def test_a_task_goes_to_the_worker_idle_the_shortest_time() -> None:
    handoff: HandOff[str] = HandOff()
    first, second = Worker[str](), Worker[str]()
    handoff.ready(first)
    handoff.ready(second)

    handoff.put("task")

    assert handoff.next(second) == "task"
    assert first._wake.locked(), "the worker idle longer was not woken"
    handoff.put("another")
    assert handoff.next(first) == "another"


def test_tasks_no_worker_was_free_for_are_taken_in_order() -> None:
    handoff: HandOff[int] = HandOff()
    for task in range(3):
        handoff.put(task)
    worker = Worker[int]()

    assert handoff.get(worker) == 0
    handoff.ready(worker)  # still ending task 0: handed the next one waiting
    assert handoff.next(worker) == 1
    assert handoff.get_nowait() == 2
    with pytest.raises(Empty):
        handoff.get_nowait()


def test_a_task_handed_to_an_idle_worker_is_no_longer_waiting() -> None:
    handoff: HandOff[str] = HandOff()
    worker = Worker[str]()
    handoff.ready(worker)
    handoff.put("task")

    with pytest.raises(Empty):
        handoff.get_nowait()
    assert handoff.next(worker) == "task"


class FourWorkers(DictBackend):
    """Four worker threads per operation kind; notes the thread of every store.  While
    ``gathering`` is set, a store waits until all four workers are in one."""

    concurrency = WORKERS

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.threads: list[str] = []
        self.gathering = True
        self.gathered = threading.Barrier(WORKERS, timeout=DEADLINE_S)

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        if self.gathering:
            self.gathered.wait()
        else:
            self.threads.append(threading.current_thread().name)
        return super().put_many(keys, payloads)


def test_tasks_submitted_one_after_another_run_on_the_worker_that_ran_the_one_before(
    adapters: list[BackendAdapter],
) -> None:
    adapter = open_dict(FourWorkers)
    adapters.append(adapter)
    backend = adapter.backend
    assert isinstance(backend, FourWorkers)
    client = BlockingAdapterClient(adapter, timeout=DEADLINE_S)
    keys = make_keys(WORKERS + 12)
    payload = memoryview(b"kv" * 100)
    # Every worker runs a store at once, so all four have started and are idle once
    # their results are out: none comes to wait later, ahead of the one just used.
    gathering = [adapter.submit_store([key], [payload]) for key in keys[:WORKERS]]
    assert [client.wait(L2Op.STORE, task) for task in gathering] == [[True]] * WORKERS
    backend.gathering = False

    for key in keys[WORKERS:]:
        assert client.store([key], [payload]) == [True]

    assert len(set(backend.threads)) == 1, backend.threads
