"""The one adapter class: any backend, wrapped into the non-blocking ``L2Adapter``.

The adapter holds the backend (composition: nothing the backend defines can collide with
the machinery) and owns task ids and eventfds, pins, accounting and capacity, the serde
chain, listeners and the runner.  A backend whose batch methods are coroutines runs on
an event loop (:class:`~lmcache_tiers.l2.runners.LoopRunner`), any other on worker
threads (:class:`~lmcache_tiers.l2.runners.ThreadRunner`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from lmcache_tiers.errors import TiersError, raised_by_a_plugin
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.calls import checked, is_async_backend, optional_method
from lmcache_tiers.l2.circuit import AsyncCircuitBackend, CircuitBackend
from lmcache_tiers.l2.context import BackendContext
from lmcache_tiers.l2.interface import L2Adapter, L2Listener, L2Op, LookupResult
from lmcache_tiers.l2.ops import AbsenceCheckOp, BatchOp, DeleteOp, LoadOp, LookupOp, StoreOp
from lmcache_tiers.l2.runners import LoopRunner, Runner, ThreadRunner
from lmcache_tiers.l2.scan import KeyScan
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.protocols import Capacity, ObjectSize

log = logging.getLogger("lmcache_tiers.l2")

#: calls in flight at once on an event loop, unless the backend sets ``concurrency``
DEFAULT_ASYNC_CONCURRENCY = 64
#: keys fetched per cross-thread round trip by ``iter_keys``
_ITER_BATCH = 1024

__all__ = ["BackendAdapter", "BackendCloseFailed", "BackendCloseTimedOut", "ObjectSize"]


class BackendCloseFailed(TiersError):
    """The backend's own ``close`` raised (counted ``backend_close_failures``; the error is
    its cause, for the caller to log).  What it left undone -- a last checkpoint, commit words of objects
    deleted meanwhile -- may bring deleted objects back at the next start, so the close
    fails rather than passing for a clean one."""


class BackendCloseTimedOut(BackendCloseFailed):
    """The backend's own ``close`` did not return within ``close_backend_timeout_s`` and was
    left running (counted ``backend_close_timeouts``, logged by the runner).  It may not
    have flushed, checkpointed or released what it holds, as one that raised: the close
    fails the same way."""


def capacity_of(value: Any) -> Capacity | None:
    """A backend's ``capacity()`` answer as a :class:`Capacity` (None: no limit)."""
    if value is None or isinstance(value, Capacity):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return Capacity(bytes=value)
    raise ValueError(f"capacity() returned {value!r}: an int of bytes, a Capacity or None")


class BackendAdapter(L2Adapter):
    """Wraps one backend; see :mod:`lmcache_tiers.protocols` for what a backend provides."""

    #: how long ``close()`` waits for backend calls already running before failing them
    #: (and how long building the adapter waits for an asynchronous ``open``)
    close_timeout_s: ClassVar[float] = 30.0
    #: how long ``close()`` then waits for the backend's own ``close`` (which may be stuck in
    #: storage: removing files on a hung mount) before going on without it
    close_backend_timeout_s: ClassVar[float] = 30.0

    def __init__(self, backend: object, context: BackendContext) -> None:
        state: AdapterState = context._state
        self.backend = backend
        self.state = state
        self.name = state.name
        self.config = state.facts.config
        self.needs_l1_buffers = bool(getattr(backend, "needs_l1_buffers", False))
        self._closed = False
        self._lock = threading.Lock()
        # The keys the last ``delete`` refused for core's own reasons (``pinned``).
        self._refused: frozenset[ObjectKey] = frozenset()
        state.adapter = self
        concurrency = getattr(backend, "concurrency", None)
        #: the backend's ImmediateLookups method, when it has one
        self._contains_now = optional_method(backend, "contains_many_now")
        self.runner: Runner
        if is_async_backend(backend):
            self.runner = LoopRunner(
                state, backend, self._publish, int(concurrency or DEFAULT_ASYNC_CONCURRENCY)
            )
        else:
            self.runner = ThreadRunner(state, backend, self._publish, int(concurrency or 1))
        self.scan = KeyScan(state, self.runner, self.capacity)
        try:
            self.runner.open(self.close_timeout_s)
        except BaseException:
            self._closed = True
            # The start-up's own error is the one raised; a close failing on top is
            # counted and logged by _close_backend.
            self._close_backend(time.monotonic() + self.close_backend_timeout_s)
            raise
        self.scan.start()

    # -- plumbing ----------------------------------------------------------------------------

    def _publish(self, task_id: int, op: BatchOp, result: Any) -> None:
        if not self.state.board.complete(task_id, result):
            op.released()

    def _submit(self, op: BatchOp) -> int:
        assert op.kind is not None
        board = self.state.board
        task_id = board.new_task(op.kind, len(op.keys))
        with self._lock:
            if not self._closed:
                self.state.count(f"{op.kind.name.lower()}_tasks")
                self.runner.run(task_id, op)
                return task_id
        self.state.count("tasks_failed_closed")
        board.fail(task_id)
        return task_id

    def _limit(self) -> Capacity | None:
        return capacity_of(self.backend.capacity())  # type: ignore[attr-defined]

    def capacity(self) -> Capacity | None:
        """The backend's capacity, or None when it has none (or cannot tell)."""
        try:
            return self._limit()
        except Exception as exc:
            self.state.backend_failed("capacity", exc)
            return None

    @staticmethod
    def _check_lengths(
        keys: Sequence[ObjectKey], buffers: Sequence[memoryview], layouts: Sequence[str] | None = None
    ) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if layouts is not None and len(layouts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def circuit_open(self) -> bool:
        """Whether the backend's circuit breaker is open now: every call is refused without
        reaching the backend (False when it has no breaker)."""
        guard = self.backend
        return isinstance(guard, (CircuitBackend, AsyncCircuitBackend)) and guard.breaker.is_open

    # -- L2Adapter ---------------------------------------------------------------------------

    def event_fd(self, op: L2Op) -> int:
        return self.state.board.event_fd(op)

    def submit_store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None = None,
    ) -> int:
        self._check_lengths(keys, buffers, layouts)
        return self._submit(StoreOp(self.state, keys, buffers, layouts, self._limit))

    def pop_completed_stores(self) -> dict[int, list[bool]]:
        return self.state.board.pop(L2Op.STORE)

    def submit_lookup_and_lock(self, keys: Sequence[ObjectKey]) -> int:
        return self._submit(LookupOp(self.state, keys, self.capacity))

    def pop_completed_lookups(self) -> dict[int, LookupResult]:
        return self.state.board.pop(L2Op.LOOKUP)

    @property
    def answers_lookups_now(self) -> bool:
        # A backend with ``contains_many_now`` may know it never answers with it (fs on a
        # remote root, mock with a simulated latency) and say so as ``answers_lookups_now``.
        return self._contains_now is not None and bool(getattr(self.backend, "answers_lookups_now", True))

    def lookup_and_lock_now(self, keys: Sequence[ObjectKey]) -> LookupResult | None:
        """The lookup run here, on the caller's thread, when the backend answers it from
        memory (``contains_many_now``); None otherwise, with nothing held or counted.

        The same operation as a submitted lookup -- pins taken first, so a key being
        deleted is a miss, then the backend's answer checked and accounted by the same
        code -- only without the worker thread in between.
        """
        contains_now = self._contains_now
        if contains_now is None or self._closed or self.runner.opened(0.0) is not True:
            return None
        op = LookupOp(self.state, keys, self.capacity)
        (io_keys,) = op.prepare()
        answer: list[Any] | None = []
        if io_keys:
            try:
                reported = contains_now(io_keys)
                answer = None if reported is None else checked("contains_many", reported, len(io_keys))
            except (Exception, asyncio.CancelledError) as exc:
                # A plain method running coroutines of its own may raise CancelledError (no
                # Exception): nothing here cancels it, so it is the backend's failure.
                self.state.backend_failed("contains_many_now", exc)
                answer = None
            except BaseException as exc:
                if not raised_by_a_plugin(exc):
                    op.abandon()  # an interrupt: the pins and reads prepare took go back first
                    raise
                # Off the main thread only the plugin raises one: escaping, it would end the
                # front end's request thread that asked.
                self.state.backend_failed("contains_many_now", exc)
                answer = None
        if answer is None or self._closed:
            op.abandon()  # what prepare took; the worker asks again
            return None
        self.state.count("lookups_answered_now")
        result: LookupResult = op.finish(answer)
        return result

    def submit_load(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> int:
        self._check_lengths(keys, buffers)
        return self._submit(LoadOp(self.state, keys, buffers))

    def pop_completed_loads(self) -> dict[int, list[bool]]:
        return self.state.board.pop(L2Op.LOAD)

    def unlock(self, keys: Sequence[ObjectKey]) -> None:
        self.state.pins.unpin(keys)

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Delete now, on the caller's thread.  False for keys not deleted: absent, not
        removed by the backend, pinned (between lookup and load), or being stored -- a
        store of the same key in its backend call is never raced (``DeleteOp``,
        ``delete_skipped_storing``), so accounting and listeners follow the backend."""
        if self._closed:
            return [False] * len(keys)
        op = DeleteOp(self.state, keys)
        result: list[bool] = self.runner.call_now(op)
        self._refused = op.refused
        if (op.unconfirmed or op.unaccounted) and not self._closed:
            # ``delete_many`` answers False for "absent" and for "could not remove" alike.
            # An accounted key that is absent was removed behind this adapter's back; asked
            # nothing, it would overstate the usage and stay an eviction victim for good.
            # An unaccounted one may have been listed (the eviction policy is seeded from
            # ``iter_keys``), and would stay a victim for good too.  Either stays False
            # here: this call did not delete it.
            self.runner.call_now(AbsenceCheckOp(self.state, op.unconfirmed, op.unaccounted))
        return result

    def pinned(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether ``delete`` refuses each key now, or refused it at its last call, for
        core's own reasons: pinned, a store of it in flight, or another delete working on
        it -- not because the backend failed to remove it.  The last call's refusals count
        too: a pin or store that ended since must not make one look like the backend's."""
        refused = self._refused
        return [busy or key in refused for key, busy in zip(keys, self.state.pins.busy(keys), strict=True)]

    def usage(self) -> float:
        return self.state.accounting.usage(self.capacity())

    def used_bytes(self) -> int:
        return self.state.accounting.used_bytes

    def used_bytes_by_salt(self) -> dict[str, int]:
        return self.state.accounting.by_salt()

    def iter_keys(self) -> Iterator[ObjectKey]:
        if self._closed:
            return
        pair = self.scan.pair
        for batch in self.runner.listing(_ITER_BATCH):
            for entry in batch:
                # Entries the start-up scan ignores (counted there as not (key, size)
                # pairs) are skipped: one would end the listing, or list a non-key.
                listed = pair(entry)
                if listed is not None:
                    yield listed[0]

    def add_listener(self, listener: L2Listener) -> None:
        self.state.add_listener(listener)

    def pinned_keys(self) -> dict[ObjectKey, int]:
        """Pin count of every pinned key (diagnostics; tests that locks return to zero)."""
        return self.state.pins.snapshot()

    def l1_size_of(self, key: ObjectKey) -> int | None:
        return self.state.l1_size_of(key)

    def own_stat_names(self) -> set[str]:
        """The names among :meth:`stats` the core keeps for this adapter rather than its
        plugin's ``stats()``: the counters (drops and refusals counted through the context
        among them), the scan's, the tasks and pins gauges and the circuit breaker's gauges.
        A status carries all of these, and caps the plugin's only (storage_status.py)."""
        names = set(self._own_stats())
        guard = self.backend
        if isinstance(guard, (CircuitBackend, AsyncCircuitBackend)):
            names.update(guard.breaker.gauges())
        return names

    def _own_stats(self) -> dict[str, int]:
        counters = self.state.counters.snapshot()
        counters.update(self.scan.stats())
        counters["pending_tasks"] = self.state.board.pending_count()
        counters["pinned_keys"] = len(self.state.pins.snapshot())
        counters["objects"] = len(self.state.accounting)
        return counters

    def stats(self) -> dict[str, int]:
        counters = self._own_stats()
        gauges = getattr(self.backend, "stats", None)
        if callable(gauges):
            try:
                counters.update({str(name): int(value) for name, value in gauges().items()})
            except Exception as exc:
                self.state.backend_failed("stats", exc)
        guard = self.backend
        if isinstance(guard, (CircuitBackend, AsyncCircuitBackend)):
            # Core's own, as the counters above: the guard merges them into the plugin's
            # stats(), which leaves them out when it raises -- a backend down, say, just
            # when ``circuit_open`` is 1.
            counters.update(guard.breaker.gauges())
        for serde in self.state.chain.serdes:  # a serde may count what it did, as serde_<name>_*
            serde_stats = getattr(serde, "stats", None)
            if callable(serde_stats):
                try:
                    reported = {f"serde_{serde.name}_{k}": int(v) for k, v in serde_stats().items()}
                except Exception as exc:
                    self._serde_stats_failed(serde.name, exc, counters)
                    continue
                # Added up: a chain may hold two stages of one name (two aesgcm keys).
                for name, value in reported.items():
                    counters[name] = counters.get(name, 0) + value
        return counters

    def _serde_stats_failed(self, serde: str, exc: Exception, counters: dict[str, int]) -> None:
        # Counted in the answer being built too (its snapshot was taken already): the
        # scrape that misses a serde's counters says so.  Scraped often: rate-limited.
        self.state.count("serde_stats_failed")
        counters["serde_stats_failed"] = counters.get("serde_stats_failed", 0) + 1
        self.state.burst.warn(
            f"serde_stats:{serde}",
            "%s: stats of serde %s failed (its counters are left out): %s: %s",
            self.name,
            serde,
            type(exc).__name__,
            exc,
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.state.closing.set()
        deadline = time.monotonic() + self.close_timeout_s
        self.runner.stop(deadline)
        self.scan.join(deadline)
        failed = self.state.board.fail_all_pending()
        self.state.count("tasks_failed_closed", failed)
        # A budget of its own: calls stuck until the deadline above must not leave the
        # backend no time to close (flush, remove its files, release its directory).
        failure = self._close_backend(time.monotonic() + self.close_backend_timeout_s, log_failure=False)
        if isinstance(failure, BackendCloseTimedOut):
            raise failure
        if failure is not None:
            # Logged once, by whoever meets the error (the storage's close step logs it
            # with the chained traceback).
            raise BackendCloseFailed(
                f"{self.name}: closing the backend failed: {type(failure).__name__}: {failure}"
            ) from failure

    def _close_backend(self, deadline: float, *, log_failure: bool = True) -> Exception | None:
        """Close the backend; what its close raised (counted, and logged if
        ``log_failure``), a :class:`BackendCloseTimedOut` if it did not return by
        ``deadline`` (counted and logged by the runner), or None."""
        failure: Exception | None = None
        budget = max(0.0, deadline - time.monotonic())
        try:
            if not self.runner.close_backend(deadline):
                failure = BackendCloseTimedOut(
                    f"{self.name}: the backend's close did not return in {budget:.1f} s "
                    "(close_backend_timeout_s); left running, what it had left to do may stay undone"
                )
        except Exception as exc:
            failure = exc
            self.state.count("backend_close_failures")
            if log_failure:
                log.exception("%s: closing the backend failed", self.name)
        self.state.chain.pool.clear()
        return failure
