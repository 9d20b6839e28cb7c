"""One log line per burst of like warnings, so a storm of drops never floods the log.

The exact figures are always in the counters (``/metrics``); the log says that something
happens and how often, once per window.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import Counter
from typing import Any

__all__ = ["BURST_WINDOW_S", "BurstLog", "PolicyFailureLog", "report_held_back"]

#: a repeated warning is logged once per this many seconds, with the count of the others
BURST_WINDOW_S = 60.0

_L2_LOG = logging.getLogger("lmcache_tiers.l2")

#: every BurstLog of the process, for ``report_held_back``
_LOGS: weakref.WeakSet[BurstLog] = weakref.WeakSet()
_LOGS_LOCK = threading.Lock()


def report_held_back(now: float | None = None) -> None:
    """Every log's :meth:`BurstLog.report_held_back`: the server calls it about once a
    second while it serves (``now``), and once more as it stops (every kind)."""
    with _LOGS_LOCK:
        logs = list(_LOGS)
    for log in logs:
        log.report_held_back(now)


class BurstLog:
    """Logs the first warning of a kind at once, then at most one per ``window_s`` for that
    kind, telling how many like it were only counted meanwhile.

    ``warn(kind, message, *args)`` for free-form warnings of several kinds; a log made for
    one failure ``reason`` also takes ``event(count, what)``: "``count`` ``what`` (failure
    reason ...)".  Lines go out at ``level`` (WARNING unless told; ERROR for a log of lost
    acknowledged writes), or at the ``level`` one ``warn`` call gives.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        reason: str | None = None,
        *,
        window_s: float = BURST_WINDOW_S,
        level: int = logging.WARNING,
    ) -> None:
        self._log = logger if logger is not None else _L2_LOG
        self.reason = reason
        self.level = level
        self.window_s = window_s
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()
        #: per kind, the last warning held back (message, arguments, level)
        self._held: dict[str, tuple[str, tuple[Any, ...], int]] = {}
        with _LOGS_LOCK:
            _LOGS.add(self)

    def warn(self, kind: str, message: str, *args: Any, count: int = 1, level: int | None = None) -> None:
        """Log ``message % args`` (at ``level``, else the log's) unless a line of ``kind``
        was logged within the window; then only add ``count`` to the tally the next line of
        that kind reports."""
        now = time.monotonic()
        # An exception goes into the record as its text: handlers that keep records (test
        # capture, memory handlers) would otherwise keep its traceback, whose frames hold
        # the batch's buffers -- views into L1 that then outlive the arena.
        args = tuple(str(arg) if isinstance(arg, BaseException) else arg for arg in args)
        level = self.level if level is None else level
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._suppressed[kind] += count
                self._held[kind] = (message, args, level)
                return
            self._next[kind] = now + self.window_s
            suppressed = self._suppressed.pop(kind, 0)
            self._held.pop(kind, None)
        if suppressed:
            message += " (and %d more like it in the last %.0f s)"
            args = (*args, suppressed, self.window_s)
        self._log.log(level, message, *args)

    def report_held_back(self, now: float | None = None) -> None:
        """Log the warnings held back of each kind whose window has ended by ``now`` (every
        kind when None: the process stops) -- the last of them, with how many there were.
        Else a burst followed by quiet would leave its tail in no log line until the next
        warning of its kind, maybe never; a line logged here starts a new window."""
        with self._lock:
            due = [kind for kind in self._suppressed if now is None or now >= self._next.get(kind, 0.0)]
            held = [(self._suppressed.pop(kind), *self._held.pop(kind)) for kind in due]
            for kind in due:
                if now is not None:
                    self._next[kind] = now + self.window_s
        for count, message, args, level in held:
            self._log.log(
                level,
                message + " (%d like it held back in the last %.0f s, this the last)",
                *args,
                count,
                self.window_s,
            )

    def event(self, count: int, what: str) -> None:
        """``count`` events of this log's failure reason, described by ``what``."""
        reason = self.reason or "unspecified"
        self.warn(reason, "%d %s (failure reason %s)", count, what, reason, count=count)


class PolicyFailureLog:
    """The log lines of a policy's failures (or a controller's steps', or a listener's),
    one failure ``reason``: the first failure with its traceback (a bug, to be found and
    fixed), later ones at most one line per burst window, telling how many were only
    counted meanwhile.

    A policy with a bug often fails on every call -- every lookup, every stored batch --
    and a traceback each time would bury the log; the counter has every one of them.
    """

    def __init__(self, logger: logging.Logger, reason: str) -> None:
        self._logger = logger
        self._burst = BurstLog(logger, reason)
        self._lock = threading.Lock()  # listeners report from adapter threads
        self._traced = False

    def failed(self, message: str, *args: object) -> None:
        """Log the failure being handled (call from an ``except`` block)."""
        with self._lock:
            first, self._traced = not self._traced, True
        if first:
            self._logger.exception(message, *args)
            return
        # Without a traceback, the exception is named: a later bug of the same policy,
        # another than the one traced first, is then told apart.
        error = sys.exc_info()[1]
        reason = self._burst.reason or "unspecified"
        self._burst.warn(
            reason, message + ": %s: %s (failure reason %s)", *args, type(error).__name__, error, reason
        )
