"""Blocking calls over an adapter's non-blocking interface.

For code that simply wants "store this and tell me how it went": tests, benchmarks and
tools (it needs no pytest).  Several threads may wait on the same client; one of them
polls the operation's eventfd at a time and hands every popped result to its waiter.  The
controllers do not use this: they multiplex many tasks on the eventfds themselves.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.interface import L2Adapter, L2Op, LookupResult

#: passed as a call's ``timeout``: use the timeout the client was created with
USE_CLIENT_TIMEOUT = -1.0
#: longest single wait on an eventfd before the poller re-checks deadlines and results
_SLICE_S = 0.05


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


@dataclass
class _OpState:
    pop: Callable[[], dict[int, Any]]
    fd: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    results: dict[int, Any] = field(default_factory=dict)
    polling: bool = False
    #: task id -> keys of lookups whose waiter gave up (their pins are dropped on arrival)
    abandoned: dict[int, list[ObjectKey]] = field(default_factory=dict)


class BlockingAdapterClient:
    """Submit, wait for the result and return it; ``TimeoutError`` after ``timeout``.

    ``timeout=None`` waits without limit.  Giving up on a store or a load is only safe for
    callers that keep the buffers alive and unchanged anyway: the adapter may still read or
    write them after the timeout.
    """

    def __init__(self, adapter: L2Adapter, *, timeout: float | None = 60.0) -> None:
        self.adapter = adapter
        self.timeout = timeout
        pops: dict[L2Op, Callable[[], dict[int, Any]]] = {
            L2Op.STORE: adapter.pop_completed_stores,
            L2Op.LOOKUP: adapter.pop_completed_lookups,
            L2Op.LOAD: adapter.pop_completed_loads,
        }
        self._ops = {op: _OpState(pops[op], adapter.event_fd(op)) for op in L2Op}

    def store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        timeout: float | None = USE_CLIENT_TIMEOUT,
        layouts: Sequence[str] | None = None,
    ) -> list[bool]:
        task_id = self.adapter.submit_store(keys, buffers, layouts)
        result: list[bool] = self.wait(L2Op.STORE, task_id, timeout)
        return result

    def lookup_and_lock(
        self, keys: Sequence[ObjectKey], timeout: float | None = USE_CLIENT_TIMEOUT
    ) -> LookupResult:
        task_id = self.adapter.submit_lookup_and_lock(keys)
        result: LookupResult = self.wait(L2Op.LOOKUP, task_id, timeout, keys=keys)
        return result

    def load(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        timeout: float | None = USE_CLIENT_TIMEOUT,
    ) -> list[bool]:
        result: list[bool] = self.wait(L2Op.LOAD, self.adapter.submit_load(keys, buffers), timeout)
        return result

    def wait(
        self,
        op: L2Op,
        task_id: int,
        timeout: float | None = USE_CLIENT_TIMEOUT,
        *,
        keys: Sequence[ObjectKey] = (),
    ) -> Any:
        """Block until task ``task_id`` of ``op`` completes and return its result.

        ``keys`` (lookups only) lets a timed-out lookup's pins be dropped when its result
        eventually arrives, so giving up never leaks pins.  ``timeout`` None waits without
        limit; by default the client's own timeout applies.
        """
        state = self._ops[op]
        limit = self.timeout if timeout is not None and timeout < 0 else timeout
        deadline = None if limit is None else time.monotonic() + limit
        with state.cond:
            while True:
                if task_id in state.results:
                    return state.results.pop(task_id)
                remaining = _remaining(deadline)
                if remaining is not None and remaining <= 0:
                    self._give_up(state, task_id, keys)
                    raise TimeoutError(f"{self.adapter.name}: {op.name.lower()} task {task_id} timed out")
                if not state.polling:
                    state.polling = True
                    break
                state.cond.wait(remaining)
        try:
            return self._poll_until(state, task_id, deadline, op, keys)
        finally:
            with state.cond:
                state.polling = False
                state.cond.notify_all()

    def _poll_until(
        self, state: _OpState, task_id: int, deadline: float | None, op: L2Op, keys: Sequence[ObjectKey]
    ) -> Any:
        while True:
            remaining = _remaining(deadline)
            if remaining is None or remaining > 0:
                # Short slices: another waiter's deadline may be nearer than ours.
                select.select([state.fd], [], [], min(remaining or _SLICE_S, _SLICE_S))
            popped = state.pop()
            with state.cond:
                for popped_id, result in popped.items():
                    abandoned_keys = state.abandoned.pop(popped_id, None)
                    if abandoned_keys is None:
                        state.results[popped_id] = result
                    elif isinstance(result, LookupResult) and len(abandoned_keys) == len(result.found):
                        # A lookup given up without its keys (a bare wait()) cannot name its
                        # pins; raising here would lose the other results of this pop.
                        hits = zip(abandoned_keys, result.found, strict=True)
                        self.adapter.unlock([key for key, hit in hits if hit])
                if popped:
                    state.cond.notify_all()
                if task_id in state.results:
                    return state.results.pop(task_id)
                if deadline is not None and time.monotonic() >= deadline:
                    self._give_up(state, task_id, keys)
                    raise TimeoutError(f"{self.adapter.name}: {op.name.lower()} task {task_id} timed out")

    @staticmethod
    def _give_up(state: _OpState, task_id: int, keys: Sequence[ObjectKey]) -> None:
        state.abandoned[task_id] = list(keys)
