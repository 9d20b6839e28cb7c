"""Ending the server's process once the server has stopped.

Python's exit joins every non-daemon thread that is still running, worker pools'
included.  A storage call stuck for good (a read on a hung NFS mount, a device that stopped
answering) holds its thread past the server's shutdown budget -- the adapter was closed
without it, its buffers given up -- and the process would then not end for as long as the
call is stuck.  Once the server has stopped, the process leaves without those threads.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType

logger = logging.getLogger("lmcache_tiers.server")

#: how long threads still running after the stop get to end by themselves
LINGER_S = 1.0

#: how often the linger looks for a Ctrl-C that came while it joins a thread
_CTRL_C_CHECK_S = 0.05


class _CtrlCWhileLingering:
    """SIGINT's handler while the process lingers: it records the Ctrl-C instead of raising.

    Raised there, the KeyboardInterrupt unwound past the exit that leaves stuck threads
    behind, and Python's exit then joined them: the process hung until a second Ctrl-C.
    It is not raised into the join to end the wait either: Python (3.11) then takes the
    joined thread for stopped, and it would be missing from the threads logged."""

    def __init__(self) -> None:
        self.came = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.came = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once

    @classmethod
    def take(cls) -> _CtrlCWhileLingering | None:
        """Handle SIGINT while lingering where it would raise KeyboardInterrupt; left alone
        where it does something else (ignored as inherited, ends the process at once)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return None
        handler = cls()
        signal.signal(signal.SIGINT, handler)
        return handler

    def give_back(self) -> None:
        """Raise KeyboardInterrupt at a Ctrl-C again.  Also once a Ctrl-C came (the handler
        then left SIG_DFL) and no thread was stuck after all: the process goes on to exit
        as it would, and a Ctrl-C in that exit must not kill it by the signal."""
        current = signal.getsignal(signal.SIGINT)
        if current is self or (self.came and current == signal.SIG_DFL):
            signal.signal(signal.SIGINT, signal.default_int_handler)


def leave_past_stuck_threads(code: int, linger_s: float = LINGER_S) -> None:
    """Return when no other non-daemon thread is left (or one ends within ``linger_s``);
    else log them and end the process now with ``code``.  A Ctrl-C meanwhile ends the
    wait: the process leaves at once, with ``code`` all the same (the stop's outcome)."""
    ctrl_c = _CtrlCWhileLingering.take()
    try:
        stuck = _still_running_after(linger_s, ctrl_c)
    except BaseException:
        if ctrl_c is not None:
            ctrl_c.give_back()
        raise
    if not stuck:
        if ctrl_c is not None:
            ctrl_c.give_back()
        return
    # Kept while leaving: a Ctrl-C raised in the log or flush below would unwind past the
    # exit into Python's, which joins the stuck threads.
    if ctrl_c is not None and ctrl_c.came:
        what = "SIGINT while waiting for %d threads still in calls after the stop (%s)"
    else:
        what = "%d threads are still stuck in calls after the stop (%s)"
    logger.warning(
        what + ": exiting without waiting for them",
        len(stuck),
        ", ".join(sorted(stuck)[:8]) + (", ..." if len(stuck) > 8 else ""),
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _still_running_after(linger_s: float, ctrl_c: _CtrlCWhileLingering | None) -> list[str]:
    """The names of the other non-daemon threads still running once each got its share of
    ``linger_s`` to end, or once a Ctrl-C came (``ctrl_c``)."""
    deadline = time.monotonic() + linger_s
    stuck = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        while thread.is_alive() and not (ctrl_c is not None and ctrl_c.came):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            thread.join(min(left, _CTRL_C_CHECK_S) if ctrl_c is not None else left)
        if thread.is_alive():
            stuck.append(thread.name)
    return stuck
