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
from typing import Any

logger = logging.getLogger("lmcache_tiers.server")

#: how long threads still running after the stop get to end by themselves
LINGER_S = 1.0

#: how often the linger looks for a stop signal that came while it joins a thread
_SIGNAL_CHECK_S = 0.05


#: the stop signals the linger records, each where it has this handler
_RECORDED: dict[int, Any] = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


class _StopWhileLingering:
    """SIGINT's and SIGTERM's handler while the process lingers: it records the signal
    instead of raising or ending the process by it.

    A Ctrl-C raised there unwound past the exit that leaves stuck threads behind, and
    Python's exit then joined them: the process hung until a second Ctrl-C.  A SIGTERM
    left to its default action ended the process by the signal (exit -15), hiding the
    stop's code (3: acknowledged writes lost).  Neither is raised into the join to end the
    wait: Python (3.11) then takes the joined thread for stopped, and it would be missing
    from the threads logged."""

    def __init__(self, taken: dict[int, Any]) -> None:
        self.came: int | None = None
        self._taken = taken  # each signal handled here and the handler it had before

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.came is None:
            self.came = signum
        for sig in self._taken:  # a second signal ends the process at once
            signal.signal(sig, signal.SIG_DFL)

    @classmethod
    def take(cls) -> _StopWhileLingering | None:
        """Handle SIGINT where it would raise KeyboardInterrupt and SIGTERM where it would
        end the process by the signal; each is left alone where it does something else
        (ignored as inherited, a handler of whoever embeds the server)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        taken = {sig: handler for sig, handler in _RECORDED.items() if signal.getsignal(sig) is handler}
        if not taken:
            return None
        handler = cls(taken)
        for sig in taken:
            signal.signal(sig, handler)
        return handler

    def give_back(self) -> None:
        """Put the handlers from before back.  Also once a signal came (the handler then
        left SIG_DFL) and no thread was stuck after all: the process goes on to exit as it
        would, and a Ctrl-C in that exit must not kill it by the signal."""
        for sig, before in self._taken.items():
            current = signal.getsignal(sig)
            if current is self or (self.came is not None and current == signal.SIG_DFL):
                signal.signal(sig, before)


def leave_past_stuck_threads(code: int, linger_s: float = LINGER_S) -> None:
    """Return when no other non-daemon thread is left (or one ends within ``linger_s``);
    else log them and end the process now with ``code``.  A Ctrl-C or SIGTERM meanwhile
    ends the wait: the process leaves at once, with ``code`` all the same (the stop's
    outcome)."""
    stop = _StopWhileLingering.take()
    try:
        stuck = _still_running_after(linger_s, stop)
    except BaseException:
        if stop is not None:
            stop.give_back()
        raise
    if not stuck:
        if stop is not None:
            stop.give_back()
        return
    # Kept while leaving: a Ctrl-C raised in the log or flush below would unwind past the
    # exit into Python's, which joins the stuck threads.
    if stop is not None and stop.came is not None:
        name = signal.Signals(stop.came).name
        what = f"{name} while waiting for %d threads still in calls after the stop (%s)"
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


def _still_running_after(linger_s: float, stop: _StopWhileLingering | None) -> list[str]:
    """The names of the other non-daemon threads still running once each got its share of
    ``linger_s`` to end, or once a stop signal came (``stop``)."""
    deadline = time.monotonic() + linger_s
    stuck = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        while thread.is_alive() and not (stop is not None and stop.came is not None):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            thread.join(min(left, _SIGNAL_CHECK_S) if stop is not None else left)
        if thread.is_alive():
            stuck.append(thread.name)
    return stuck
