"""CPU priority of the threads that serve requests: a little above the process's others.

On Linux a nice value belongs to one thread and a new thread starts with its creator's.
The front ends start their threads (and the request pools theirs) from the serving
thread, after the controllers and adapters started their own, so raising the serving
thread's priority just before the front ends start favours exactly the request path over
background work and over other processes of the same user -- by weight, never so much that
a busy server could starve them.  The write-back threads lower their own priority further
(:mod:`lmcache_tiers.l2.background`).

Raising a priority needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it: where the
OS refuses, the server logs one line and serves at the priority it was started with.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["REQUEST_NICE", "request_threads_favoured"]

logger = logging.getLogger(__name__)

#: nice value of the request path: weight ~3x a nice-0 thread's when they compete for a core
REQUEST_NICE = -5


@contextmanager
def request_threads_favoured() -> Iterator[bool]:
    """Threads started in the block by the calling thread run at ``REQUEST_NICE`` (only
    on the main thread: a server started inside another program, such as a test, leaves
    that program's priorities alone); yields whether they do."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(os, "setpriority"):
        yield False
        return
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    if before <= REQUEST_NICE:
        yield False  # started at this priority or a better one already
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, REQUEST_NICE)
    except OSError as exc:
        logger.info("request threads keep nice %d: the OS refused nice %d (%s)", before, REQUEST_NICE, exc)
        yield False
        return
    try:
        yield True
    finally:
        # Shutdown work (draining, closing adapters) on this thread is not request work.
        try:
            os.setpriority(os.PRIO_PROCESS, tid, before)
        except OSError as exc:
            logger.info(
                "the serving thread stays at nice %d: the OS refused nice %d (%s)", REQUEST_NICE, before, exc
            )
