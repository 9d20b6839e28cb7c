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
import sys
import threading
import time

logger = logging.getLogger("lmcache_tiers.server")

#: how long threads still running after the stop get to end by themselves
LINGER_S = 1.0


def leave_past_stuck_threads(code: int, linger_s: float = LINGER_S) -> None:
    """Return when no other non-daemon thread is left (or one ends within ``linger_s``);
    else log them and end the process now with ``code``."""
    deadline = time.monotonic() + linger_s
    stuck = []
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            stuck.append(thread.name)
    if not stuck:
        return
    logger.warning(
        "%d threads are still stuck in calls after the stop (%s): exiting without waiting for them",
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
