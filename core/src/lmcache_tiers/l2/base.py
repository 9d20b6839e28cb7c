"""Base classes for adapters written as plain batch I/O.

:class:`BatchL2Adapter` is for synchronous backends: each operation kind (store, lookup,
load) has its own worker thread(s), so a long store never delays a prefetch lookup.  The
backend methods may therefore run concurrently with each other (and with ``delete_many``,
called on the thread that calls ``delete``) and must be thread-safe; with
``workers_per_op > 1`` the same method may also run concurrently with itself.

:class:`AsyncBatchL2Adapter` (in :mod:`lmcache_tiers.l2.aio`, re-exported here) is for
coroutine backends.

A subclass implements::

    def put_many(self, keys, payloads: Sequence[memoryview]) -> list[bool]
    def contains_many(self, keys) -> list[int | ObjectSize | None]
    def get_many_into(self, keys, buffers: Sequence[memoryview]) -> list[bool]
    def delete_many(self, keys) -> list[bool]
    def iter_keys(self) -> Iterator[ObjectKey]
    def capacity_bytes(self) -> int | None
    def close_backend(self) -> None                      # optional

``contains_many`` reports the *stored* size of each hit (what ``put_many`` received), or
``ObjectSize(stored, l1)`` when it knows both -- persistent adapters read ``l1_size`` from
the record header, which is how the L1 size of an object stored by an earlier process is
recovered when the serde chain changes sizes.  ``get_many_into`` receives buffers of
exactly the stored size and fills them completely, or reports False for that key.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.accounting import ObjectSize
from lmcache_tiers.l2.aio import AsyncBatchL2Adapter
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.core import AdapterCore, ContainsResult, log
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.l2.ops import DeleteOp, LoadOp, LookupOp, StoreOp

__all__ = ["AsyncBatchL2Adapter", "BatchL2Adapter", "ContainsResult", "ObjectSize"]

_Job = Callable[[int], None]


class BatchL2Adapter(AdapterCore):
    """Base class of synchronous adapters; see the module docstring for the contract."""

    #: worker threads per operation kind (store, lookup, load)
    workers_per_op: ClassVar[int] = 1

    def __init__(self, config: L2AdapterConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self._queues: dict[L2Op, queue.SimpleQueue[tuple[int, _Job] | None]] = {}
        self._workers: list[threading.Thread] = []

    # -- plain batch I/O, implemented by the adapter ---------------------------------------

    @abstractmethod
    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        """Store each payload under its key (replacing an existing object)."""

    @abstractmethod
    def contains_many(self, keys: Sequence[ObjectKey]) -> Sequence[ContainsResult]:
        """Stored size (or both sizes) of each present key, None for a miss."""

    @abstractmethod
    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        """Copy each object into its buffer (exactly the stored size)."""

    @abstractmethod
    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Remove each key; False where it was absent or could not be removed."""

    @abstractmethod
    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every stored key."""

    def interrupt_backend(self) -> None:
        """Unblock backend calls in progress (optional); called once when ``close()`` starts.

        Calls still running are waited for (up to ``close_timeout_s``) before
        ``close_backend``; an adapter whose calls can block for long (a remote peer, a
        wrapped adapter) makes them return early here.  Sleeps through
        ``sleep_unless_closed`` are already cut short.
        """

    def close_backend(self) -> None:
        """Release the backend (connections, files); called once, after the workers stop."""

    # -- worker plumbing ------------------------------------------------------------------

    def _start_workers(self) -> None:
        # Started on first use rather than in __init__, so a subclass finishes its own
        # __init__ before any thread can call into it.
        for op in L2Op:
            self._queues[op] = queue.SimpleQueue()
            for number in range(max(1, self.workers_per_op)):
                thread = threading.Thread(
                    target=self._work,
                    args=(self._queues[op],),
                    name=f"l2-{self.name}-{op.name.lower()}-{number}",
                    daemon=True,
                )
                thread.start()
                self._workers.append(thread)

    def _work(self, jobs: queue.SimpleQueue[tuple[int, _Job] | None]) -> None:
        while True:
            item = jobs.get()
            if item is None:
                return
            task_id, job = item
            try:
                job(task_id)
            except BaseException:  # never let one task kill the worker
                log.exception("%s: task %d crashed", self.name, task_id)
                self.board.fail(task_id)

    def _enqueue(self, op: L2Op, count: int, job: _Job) -> int:
        def start(task_id: int) -> None:
            if not self._workers:
                self._start_workers()
            self._queues[op].put((task_id, job))

        return self.submit(op, count, start)

    def _call(self, method: str, keys: list[ObjectKey], *args: Sequence[memoryview]) -> list[Any] | None:
        """Run one backend method; None when it raised or answered the wrong length."""
        if not keys:
            return []
        try:
            result = getattr(self, method)(keys, *args)
            return list(self.check_result(result, len(keys), method))
        except Exception as exc:
            self.backend_failed(method, exc)
            return None

    # -- L2Adapter --------------------------------------------------------------------------

    def submit_store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None = None,
    ) -> int:
        self.validate_batch(keys, buffers, layouts)
        op = StoreOp(self, keys, buffers, layouts)

        def job(task_id: int) -> None:
            io_keys, payloads = op.prepare()
            result = self._call("put_many", io_keys, payloads)
            self.publish(task_id, op, op.finish(result))

        return self._enqueue(L2Op.STORE, len(op.keys), job)

    def submit_lookup_and_lock(self, keys: Sequence[ObjectKey]) -> int:
        op = LookupOp(self, keys)

        def job(task_id: int) -> None:
            io_keys = op.prepare()
            result = self._call("contains_many", io_keys)
            self.publish(task_id, op, op.finish(result))

        return self._enqueue(L2Op.LOOKUP, len(op.keys), job)

    def submit_load(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> int:
        self.validate_batch(keys, buffers)
        op = LoadOp(self, keys, buffers)

        def job(task_id: int) -> None:
            io_keys, targets = op.prepare()
            result = self._call("get_many_into", io_keys, targets)
            self.publish(task_id, op, op.finish(result))

        return self._enqueue(L2Op.LOAD, len(op.keys), job)

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if self.closed:
            return [False] * len(keys)
        op = DeleteOp(self, keys)
        io_keys = op.prepare()
        return op.finish(self._call("delete_many", io_keys))

    def close(self) -> None:
        if not self.begin_close():
            return
        # Tasks still queued never reach the backend; running ones may finish in time.
        for jobs in self._queues.values():
            while True:
                try:
                    item = jobs.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self.board.fail(item[0])
            for _ in range(max(1, self.workers_per_op)):
                jobs.put(None)
        try:
            self.interrupt_backend()
        except Exception:
            log.exception("%s: interrupt_backend failed", self.name)
        deadline = time.monotonic() + self.close_timeout_s
        for thread in self._workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [thread.name for thread in self._workers if thread.is_alive()]
        if stuck:
            log.warning(
                "%s: backend calls still running after %.0f s: %s", self.name, self.close_timeout_s, stuck
            )
        self.finish_close()
        try:
            self.close_backend()
        except Exception:
            log.exception("%s: close_backend failed", self.name)
