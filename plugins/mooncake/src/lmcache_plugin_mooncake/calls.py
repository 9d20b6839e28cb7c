"""Mooncake calls with a deadline: a caller waits at most ``timeout`` for its answer.

The Mooncake client blocks in C++ (with the GIL released) and cannot be cancelled; its
own timeouts (set from ``operation_timeout_s``) end master RPCs and stalled transfers, but
a call stuck anywhere else must not hold the thread that made it -- a delete runs on the
thread of the controller evicting, a probe on the circuit breaker's.  Those calls
therefore run on daemon threads of this pool and the caller stops waiting at the
deadline (``CallTimeout``).  Lookups do not: they are on the request path, where the hop
to a pool thread and back cost more than the RPC, and Mooncake's timeouts end them.  A
call given up this way may still finish later: what it touches must stay valid, so the
caller passes ``on_late`` to release its resources only then.  Calls that write into
memory the caller gives back on failure (loads into L1) must not use the pool.

Daemon threads, because a call stuck forever must not keep the process from exiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from lmcache_tiers.plugin import TiersError

T = TypeVar("T")

__all__ = ["CallPool", "CallTimeout"]


class CallTimeout(TiersError):
    """A Mooncake call did not answer within its deadline (it was given up)."""


class _Call(Generic[T]):
    __slots__ = ("abandoned", "args", "done", "error", "function", "lock", "on_late", "result")

    def __init__(self, function: Callable[..., T], args: tuple[Any, ...], on_late: Callable[[], None] | None):
        self.function = function
        self.args = args
        self.on_late = on_late
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.abandoned = False
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        with self.lock:
            if self.abandoned:  # given up before it started: never run it
                late = self.on_late
                self.on_late = None
                if late is not None:
                    late()
                return
        try:
            self.result = self.function(*self.args)
        except BaseException as exc:
            self.error = exc
        with self.lock:
            self.done.set()
            late = self.on_late if self.abandoned else None
        if late is not None:
            late()

    def abandon(self) -> bool:
        """Give the call up; False if it finished meanwhile (its result can be used)."""
        with self.lock:
            if self.done.is_set():
                return False
            self.abandoned = True
            return True


class CallPool:
    """``workers`` daemon threads running calls for callers that wait with a deadline."""

    def __init__(self, name: str, workers: int) -> None:
        self._jobs: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"mooncake-{name}-{index}", daemon=True)
            for index in range(workers)
        ]
        self._busy = 0
        self._busy_lock = threading.Lock()
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (call := self._jobs.get()) is not None:
            with self._busy_lock:
                self._busy += 1
            try:
                call.run()
            finally:
                with self._busy_lock:
                    self._busy -= 1

    @property
    def busy(self) -> int:
        """Calls running right now (including given-up ones still stuck)."""
        with self._busy_lock:
            return self._busy

    def run(
        self,
        what: str,
        timeout: float,
        function: Callable[..., T],
        *args: Any,
        on_late: Callable[[], None] | None = None,
    ) -> T:
        """``function(*args)`` on a pool thread; ``CallTimeout`` after ``timeout`` seconds.

        ``on_late`` runs (on the pool thread) when a call given up at its deadline ends,
        or instead of it when it never started; it does not run for calls answered in time.
        """
        call: _Call[T] = _Call(function, args, on_late)
        self._jobs.put(call)
        if not call.done.wait(timeout) and call.abandon():
            raise CallTimeout(f"{what} did not answer within {timeout:g}s")
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def close(self) -> None:
        """Let idle threads end; threads stuck in a call end with it (they are daemons)."""
        for _ in self._threads:
            self._jobs.put(None)
