"""Threads ended by an exception, counted and logged while a server runs.

Each of the server's threads catches what its work may raise, but one that lets an
exception through (a bug, a plugin's) ends silently as far as an operator can tell: the
standard library prints the traceback to stderr, beside the log and counted nowhere, and
whatever the thread did (checkpoints, probes, a listing) stops for good.  While a server
runs, ``threading.excepthook`` counts such an end as ``thread_crashed`` and logs it with
the thread's name and traceback.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["THREAD_CRASHED", "ThreadCrashes"]

logger = logging.getLogger(__name__)

#: the failure reason a thread ended by an exception is counted under
THREAD_CRASHED = "thread_crashed"


class ThreadCrashes:
    """Installs itself as ``threading.excepthook`` until :meth:`uninstall`; hooks set
    before it (a test runner's) still run after it, the standard library's printing
    excepted (the log has it)."""

    def __init__(self, count: Callable[[str], object]) -> None:
        self._count = count
        self._previous: Callable[[Any], object] = threading.excepthook
        self._active = False

    def install(self) -> None:
        self._previous = threading.excepthook
        self._active = True
        threading.excepthook = self._hook

    def uninstall(self) -> None:
        """Stop counting; the earlier hook is put back unless another was set since
        (a second server in the process: it hands calls on to this one, which passes
        them through once inactive, and skips it when it is uninstalled in turn)."""
        self._active = False
        if threading.excepthook == self._hook:
            threading.excepthook = _past_inactive(self._previous)

    def _hook(self, args: Any) -> None:
        if not self._active or args.exc_type is SystemExit:  # SystemExit ends a thread quietly
            self._previous(args)
            return
        self._count_crash()
        name = args.thread.name if args.thread is not None else "?"
        logger.error(
            "thread %s ended by an exception (%s): the work it did stops with it",
            name,
            THREAD_CRASHED,
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )
        if self._previous is not threading.__excepthook__:
            self._previous(args)

    def _count_crash(self) -> None:
        # Raising here would lose the crash: the standard library would print the hook's
        # own traceback instead of the thread's, and nothing would be logged.
        try:
            self._count(THREAD_CRASHED)
        except Exception:
            logger.exception("counting a thread's end by an exception (%s) failed", THREAD_CRASHED)


def _past_inactive(hook: Callable[[Any], object]) -> Callable[[Any], object]:
    """``hook``, or the first hook before it that is not an uninstalled :class:`ThreadCrashes`
    (servers closed in the order they started): putting one of those back would keep it,
    and the server it counts for, for the rest of the process."""
    owner = getattr(hook, "__self__", None)
    while isinstance(owner, ThreadCrashes) and not owner._active:
        hook = owner._previous
        owner = getattr(hook, "__self__", None)
    return hook
