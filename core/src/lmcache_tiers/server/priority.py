"""CPU priority of the threads that serve requests: a little above the process's others.

On Linux a nice value belongs to one thread and a new thread starts with its creator's.
The front ends start their threads (and the request pools theirs) from the serving
thread, after the controllers and adapters started their own, so raising the serving
thread's priority just before the front ends start favours exactly the request path over
background work and over other processes of the same user -- by weight, never so much that
a busy server could starve them.  The write-back threads lower their own priority further
(:mod:`lmcache_tiers.l2.background`).

Threads a front end's libraries start before that (ZeroMQ's I/O thread starts with the
front end's socket, when the front end is built) do not inherit it, yet every request and
reply passes through them: a front end hands them the priority of the thread that starts
it (:func:`share_priority`).

Raising a priority needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it: where the
OS refuses, the server logs one line and serves at the priority it was started with.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["REQUEST_NICE", "request_threads_favoured", "share_priority", "threads_named"]

logger = logging.getLogger(__name__)

#: nice value of the request path: weight ~3x a nice-0 thread's when they compete for a core
REQUEST_NICE = -5

_refused_sharing: set[int] = set()  # nice values the OS refused to hand on: logged once


def thread_ids() -> set[int]:
    """Ids of this process's threads (empty where /proc does not list them)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def threads_named(tids: set[int], prefix: str, *, wait_s: float = 0.0) -> list[int]:
    """Those of ``tids`` whose kernel thread name begins with ``prefix``.

    A new thread names itself a moment after it starts (until then it has its creator's
    name), later still on a busy machine: with ``wait_s`` the call waits up to that long
    for at least one such name to show."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for tid in sorted(tids):
            try:
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    if comm.read().startswith(prefix):
                        found.append(tid)
            except OSError:
                continue  # ended meanwhile
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.001)


def share_priority(tids: list[int]) -> None:
    """Give threads ``tids`` of this process the nice value of the calling thread, where
    theirs is worse (threads of a front end's libraries that were started before the
    serving thread raised its own).  A refusal is logged once per nice value."""
    if not tids or not hasattr(os, "setpriority"):
        return
    wanted = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > wanted:
                os.setpriority(os.PRIO_PROCESS, tid, wanted)
        except ProcessLookupError:
            continue  # ended meanwhile
        except OSError as exc:
            if wanted not in _refused_sharing:
                _refused_sharing.add(wanted)
                logger.info("front-end I/O threads keep their nice: the OS refused nice %d (%s)", wanted, exc)
            return


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
