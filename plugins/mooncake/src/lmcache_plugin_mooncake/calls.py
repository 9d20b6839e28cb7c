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
But a daemon thread coming back out of Mooncake while the interpreter finalizes aborts
the process ('terminate called without an active exception'), so while a given-up call is
still inside, a NON-daemon thread waits for it (``_wait_given_up``): a process reaching
its normal exit waits for those calls to end (at most ``exit_wait_s``), and serve's leave
path, which ends the process at once while a non-daemon thread runs past the stop,
skips the finalization altogether.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from lmcache_tiers.plugin import TiersError

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: how often the waiter for given-up calls looks whether the main thread has ended
_MAIN_CHECK_S = 0.25

__all__ = ["CallPool", "CallTimeout", "PoolClosed"]


class CallTimeout(TiersError):
    """A Mooncake call did not answer within its deadline (it was given up)."""


class PoolClosed(TiersError):
    """A call asked of a pool already closed: refused, never queued."""


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

    def abandon(self, counted: Callable[[], None]) -> bool:
        """Give the call up; False if it finished meanwhile (its result can be used).
        ``counted`` runs under the call's lock, before the call can end as given up."""
        with self.lock:
            if self.done.is_set():
                return False
            self.abandoned = True
            counted()
            return True


class CallPool:
    """``workers`` daemon threads running calls for callers that wait with a deadline;
    a process exiting waits at most ``exit_wait_s`` for the calls given up to end."""

    def __init__(self, name: str, workers: int, exit_wait_s: float) -> None:
        self._name = name
        self._exit_wait_s = exit_wait_s
        #: calls given up and not ended yet; the waiter runs while there are any
        self._given_up = 0
        self._given_up_changed = threading.Condition()
        self._jobs: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"mooncake-{name}-{index}", daemon=True)
            for index in range(workers)
        ]
        self._busy = 0
        self._busy_lock = threading.Lock()
        #: set by ``close``; with the queueing of calls under ``_closing_lock``, so that no
        #: call is queued behind the threads' end (none would run it)
        self._closed = False
        self._closing_lock = threading.Lock()
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
                if call.abandoned:  # final once run() returned: it ended as given up
                    self._given_up_ended()

    def _given_up_began(self) -> None:
        with self._given_up_changed:
            self._given_up += 1
            if self._given_up == 1:
                waiter = threading.Thread(
                    target=self._wait_given_up, name=f"mooncake-{self._name}-given-up-calls", daemon=False
                )
                try:
                    waiter.start()
                except RuntimeError as exc:  # the interpreter is already finalizing: too late
                    logger.warning(
                        "%s: a call given up inside Mooncake at exit is not waited for (%s)", self._name, exc
                    )

    def _given_up_ended(self) -> None:
        with self._given_up_changed:
            self._given_up -= 1
            self._given_up_changed.notify_all()

    def _wait_given_up(self) -> None:
        """Run (not a daemon) until no given-up call is left, or ``exit_wait_s`` after the
        main thread ended: a call stuck for good must not keep a process from exiting."""
        main = threading.main_thread()
        exit_deadline: float | None = None
        with self._given_up_changed:
            while self._given_up > 0:
                if exit_deadline is None and not main.is_alive():
                    exit_deadline = time.monotonic() + self._exit_wait_s
                    logger.info(
                        "%s: the process waits up to %gs for %d call%s given up inside Mooncake to end "
                        "(one still inside when the interpreter finalizes aborts the process)",
                        self._name, self._exit_wait_s, self._given_up, "" if self._given_up == 1 else "s",
                    )  # fmt: skip
                if exit_deadline is not None and time.monotonic() >= exit_deadline:
                    logger.warning(
                        "%s: calls given up still inside Mooncake after %gs: %d; the process exits "
                        "without them (it may abort if one ends during the exit)",
                        self._name, self._exit_wait_s, self._given_up,
                    )  # fmt: skip
                    return
                self._given_up_changed.wait(_MAIN_CHECK_S)

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
        or instead of it when it never started; it does not run for calls answered in time,
        nor for calls refused (``PoolClosed``) because the pool was closed.
        """
        call: _Call[T] = _Call(function, args, on_late)
        with self._closing_lock:
            if self._closed:
                # Queued, it would wait out its deadline unrun, then count as a call
                # given up inside Mooncake that never ends: the process would wait for
                # it at exit (``exit_wait_s``), warning of a call that was never made.
                raise PoolClosed(f"{what} not made: the adapter's Mooncake calls are closed")
            self._jobs.put(call)
        if not call.done.wait(timeout) and call.abandon(self._given_up_began):
            raise CallTimeout(f"{what} did not answer within {timeout:g}s")
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def close(self) -> None:
        """Let idle threads end; threads stuck in a call end with it (they are daemons).
        Calls asked after this are refused (``PoolClosed``)."""
        with self._closing_lock:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
