"""Finding the coroutine that holds a coroutine backend's event loop.

A coroutine that makes a synchronous call where it should await (a blocking socket,
``time.sleep``, a lock another thread holds) stops its adapter's loop: every other call
of the adapter waits behind it, and nothing fails to say so -- the adapter only gets
slow.  A watch thread per loop pings it every ``CHECK_S``; a ping still unanswered after
``STALL_S`` while the loop's thread is inside a callback is a stall: counted once as the
adapter's ``loop_stalls`` and logged with the line of the backend's code the loop is held
at.  A loop waiting in its selector is not held, only starved of CPU (a loaded machine):
that is never counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import sys
import threading
import time
from types import FrameType
from typing import ClassVar

from lmcache_tiers.l2.state import AdapterState

log = logging.getLogger("lmcache_tiers.l2")

__all__ = ["LoopWatch", "held_at"]

#: code that runs a callback rather than being one: skipped when naming the holder
_MACHINERY = (
    os.path.dirname(asyncio.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # the runners of lmcache_tiers.l2
    threading.__file__,
)


def held_at(frame: FrameType | None) -> str | None:
    """Where a loop's thread, whose innermost frame is ``frame``, is held: the outermost
    frame that is not the loop's or the runner's own code (the backend's coroutine, at the
    line of the call that blocks), as "file:line in function"; None when the thread waits
    in the loop's selector (not held) or runs no Python code."""
    stack: list[FrameType] = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    if not stack or stack[0].f_code.co_filename == selectors.__file__:
        return None
    stack.reverse()  # outermost first
    holder = next((f for f in stack if not f.f_code.co_filename.startswith(_MACHINERY)), stack[-1])
    return f"{holder.f_code.co_filename}:{holder.f_lineno} in {holder.f_code.co_name}"


class LoopWatch:
    """Pings one adapter's event loop from a thread of its own, until :meth:`end`."""

    #: how often the loop is pinged (and a pending ping checked)
    CHECK_S: ClassVar[float] = 0.5
    #: a ping unanswered this long while a callback runs is a stall: far above what any
    #: coroutine step should take, far below the call timeouts it would otherwise run into
    STALL_S: ClassVar[float] = 2.0

    def __init__(
        self, state: AdapterState, loop: asyncio.AbstractEventLoop, thread: threading.Thread
    ) -> None:
        self._state = state
        self._loop = loop
        self._loop_thread = thread
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._ping_sent: float | None = None  # when the unanswered ping was sent
        self._stalled = False  # the unanswered ping was counted as a stall
        self._thread = threading.Thread(target=self._watch, name=f"l2-{state.name}-loop-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def end(self, timeout: float = 1.0) -> None:
        """Stop watching; waits up to ``timeout`` for the watch thread unless called on it."""
        self._ended.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _watch(self) -> None:
        while not self._ended.wait(self.CHECK_S):
            if not self._check(time.monotonic()):
                return

    def _check(self, now: float) -> bool:
        """One look at the loop; False once it can no longer be pinged (closed)."""
        with self._lock:
            sent, stalled = self._ping_sent, self._stalled
        if sent is None:
            return self._ping(now)
        if stalled or now - sent < self.STALL_S:
            return True
        ident = self._loop_thread.ident
        where = held_at(sys._current_frames().get(ident)) if ident is not None else None
        if where is None:
            return True  # waiting in its selector, or not started: starved, not held
        with self._lock:
            if self._ping_sent != sent:
                return True  # answered meanwhile
            self._stalled = True
        self._state.count("loop_stalls")
        self._state.burst.warn(
            "loop_stall",
            "%s: its event loop has run nothing for %.1f s, held at %s: a coroutine of the "
            "backend makes a blocking call where it should await, and every call of the "
            "adapter waits behind it (loop_stalls)",
            self._state.name,
            now - sent,
            where,
        )
        return True

    def _ping(self, now: float) -> bool:
        with self._lock:
            self._ping_sent = now
        try:
            self._loop.call_soon_threadsafe(self._answered, now)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _answered(self, sent: float) -> None:
        """On the loop: its ping came through."""
        with self._lock:
            stalled = self._stalled
            self._ping_sent, self._stalled = None, False
        if stalled:
            self._state.burst.warn(
                "loop_stall_end",
                "%s: its event loop runs again, after %.1f s",
                self._state.name,
                time.monotonic() - sent,
                level=logging.INFO,
            )
