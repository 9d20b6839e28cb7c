"""CPU and I/O priority of write-back threads: idle while write-back keeps up, nice 10
when it falls behind.

Write-back competes with client requests for the same cores.  At nice 10 a store thread
still ran 5 ms stretches on a core while a request thread that had just woken up waited
for it (``perf sched``), which was most of the p99 of stores and lookups under write-back.
Under ``SCHED_OTHER`` a woken thread preempts the running one only once that one used up
its slice, which the kernel notices at the next tick (4 ms at ``HZ=250``): a request thread
or a client woken on the store thread's core waited that long while the other core sat
idle.  A thread under ``SCHED_IDLE`` is preempted at once when a normal thread wakes on
its core, so it only runs on cores nothing else wants; its I/O goes in the idle I/O class
for the same reason.

But an idle-class thread that holds the GIL is preempted just as readily, and then the
request threads wait for the GIL until nothing else wants its core (``perf sched``: a
server request thread woke every 0.5 ms to ask for the GIL, with its own core idle, for
3 ms while another process ran on the store thread's).  So a write-back thread is idle-class
only inside :meth:`BackgroundThreads.copying` -- around the long calls that release the GIL
(the copies into files, checksums) -- and runs its Python between them at nice 10, where it
keeps its core for the little while it holds the GIL and gives the GIL up within the switch
interval.

An idle thread can starve while every core is busy.  The store controller reports when
write-back falls behind (:meth:`BackgroundThreads.hurry`: a flush waits, the server
stops, L1 is short of room, or the threads spent most of a window runnable but got less
of a core than nice 10 would give them, as :meth:`BackgroundThreads.cpu_s` tells) and the
threads run at nice 10 (and best-effort I/O), copies included, until it catches up: slowed,
never starved.  Nice 10 costs the requests more than idle does, so it is kept for real need.

Each step is a request to the OS that may be refused (containers, unprivileged users,
other kernels); a refusal is logged once per process and the threads stay at nice 10,
which needs no privilege.  Idle is only used where the process may return from it
(``SCHED_IDLE`` -> ``SCHED_OTHER`` at nice 10 needs ``CAP_SYS_NICE`` or an
``RLIMIT_NICE`` of at least 10; checked as root or that limit): a thread stuck idle could
starve for good.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from lmcache_tiers.tmpfs import libc_function

__all__ = ["WRITE_BACK", "WRITE_BACK_NICE", "BackgroundThreads"]

log = logging.getLogger("lmcache_tiers.l2")

#: nice value of write-back threads while they are not idle: about a tenth of a core's
#: share when every core is busy, so write-back yields to requests but is never starved
#: (at 19, ~1.5 %, a busy process could hold it back indefinitely)
WRITE_BACK_NICE = 10

# linux/ioprio.h
_IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_BE_NORMAL = 4
_SYS_IOPRIO = {"x86_64": (251, 252), "aarch64": (30, 31)}  # (ioprio_set, ioprio_get)


def _syscalls() -> tuple[int, int] | None:
    return _SYS_IOPRIO.get(os.uname().machine)


def ioprio_value(idle: bool) -> int:
    if idle:
        return _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT
    return (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | _IOPRIO_BE_NORMAL


# syscall(2) is variadic: one typed binding per argument count
_syscall2 = libc_function("syscall", (ctypes.c_long, ctypes.c_int, ctypes.c_int))
_syscall3 = libc_function("syscall", (ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int))


def get_ioprio(tid: int) -> int | None:
    """The I/O priority of thread ``tid`` as ``ioprio_get`` returns it; None where unknown."""
    numbers = _syscalls()
    if numbers is None or _syscall2 is None:
        return None
    value = int(_syscall2(numbers[1], _IOPRIO_WHO_PROCESS, tid))
    return None if value < 0 else value


def _call_error() -> OSError:
    """The error of the C library call that just failed on this thread, as ``os`` raises
    it (ESRCH a ProcessLookupError: the thread ended)."""
    errno = ctypes.get_errno()
    return OSError(errno, os.strerror(errno))


def _set_ioprio(tid: int, idle: bool) -> None:
    numbers = _syscalls()
    if numbers is None or _syscall3 is None:
        raise OSError(f"ioprio_set is not known on {os.uname().machine}")
    if _syscall3(numbers[0], _IOPRIO_WHO_PROCESS, tid, ioprio_value(idle)) != 0:
        raise _call_error()


# Not os.sched_setscheduler, which keeps the GIL: a thread made idle-class is preempted
# inside the call by any thread wanting its core, and kept the GIL from the request threads
# until that core was free again.
_sched_setscheduler = libc_function(
    "sched_setscheduler", (ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
)


def _set_policy(tid: int, policy: int) -> None:
    if _sched_setscheduler is None:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    elif _sched_setscheduler(tid, policy, ctypes.byref(ctypes.c_int(0))) != 0:
        raise _call_error()


def may_leave_idle() -> bool:
    """Whether a thread of this process may go from ``SCHED_IDLE`` back to nice 10."""
    if os.geteuid() == 0:
        return True
    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20 - WRITE_BACK_NICE


class BackgroundThreads:
    """Write-back threads of the process and the priority they run at; thread-safe."""

    def __init__(self, *, use_idle: bool | None = None) -> None:
        supported = hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")
        self._use_idle = (supported and may_leave_idle()) if use_idle is None else use_idle
        self._lock = threading.Lock()
        self._tids: set[int] = set()
        self._copying: set[int] = set()  # threads inside ``copying``: idle-class unless hurried
        self._hurried = False
        self._behind: set[int] = set()  # ids of the reporters that find write-back behind
        self._refused: set[str] = set()  # what the OS refused once: logged, not retried

    @property
    def uses_idle(self) -> bool:
        """Whether the threads' copies run idle-class while write-back keeps up."""
        return self._use_idle and "idle" not in self._refused

    @property
    def hurried(self) -> bool:
        return self._hurried

    def enter(self) -> None:
        """Make the calling thread a write-back thread (call it from that thread)."""
        tid = threading.get_native_id()
        with self._lock:
            self._tids.add(tid)
            self._apply(tid, calm=not self._hurried)

    @contextmanager
    def copying(self) -> Iterator[None]:
        """The calling write-back thread runs idle-class inside the block while write-back
        keeps up: wrap calls that release the GIL for long (a copy, a checksum), not Python
        work.  A no-op on other threads, while hurried and where idle is not used."""
        tid = threading.get_native_id()
        with self._lock:
            idle = tid in self._tids and tid not in self._copying and not self._hurried and self.uses_idle
            if idle:
                self._copying.add(tid)
                self._set_cpu(tid, idle=True)
        if idle:
            # Going idle-class does not by itself hand the core to a thread that woke while
            # this one ran at nice 10 (it would wait for the next tick): yield it.
            os.sched_yield()
        try:
            yield
        finally:
            if idle:
                with self._lock:
                    self._copying.discard(tid)
                    self._set_cpu(tid, idle=False)

    def leave(self) -> None:
        """The calling thread ends: forget it (its priority dies with it)."""
        self.forget((threading.get_native_id(),))

    def forget(self, tids: Iterable[int]) -> None:
        """Threads that ended or are ending (a pool shut down): never touched again, as their
        ids may be given to new threads."""
        with self._lock:
            self._tids.difference_update(tids)

    def cpu_s(self) -> tuple[float, float] | None:
        """(seconds run on a core, seconds runnable but not running) of the write-back
        threads, summed over their lives (``schedstat``); None where the kernel does not say."""
        with self._lock:
            tids = list(self._tids)
        ran = waited = 0
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as stat:
                    fields = stat.read().split()
                ran += int(fields[0])
                waited += int(fields[1])
            except FileNotFoundError:
                continue  # the thread just ended
            except (OSError, ValueError, IndexError):
                return None
        return ran / 1e9, waited / 1e9

    def hurry(self, behind: bool, reporter: object = None) -> None:
        """``reporter`` (a store controller) finds write-back behind (True: every thread at
        nice 10 while any reporter does) or caught up again."""
        with self._lock:
            if behind:
                self._behind.add(id(reporter))
            else:
                self._behind.discard(id(reporter))
            hurried = bool(self._behind)
            if hurried == self._hurried:
                return
            for tid in list(self._tids):
                self._apply(tid, calm=not hurried)
            # Set last: whoever reads ``hurried`` without the lock finds every thread
            # already at the priority it says.
            self._hurried = hurried
        log.debug(
            "write-back threads %s", f"behind: at nice {WRITE_BACK_NICE}" if hurried else "idle while copying"
        )

    # -- the OS requests ----------------------------------------------------------------

    def _apply(self, tid: int, *, calm: bool) -> None:
        """``calm``: write-back keeps up (idle I/O class, idle CPU class inside copies)."""
        self._set_cpu(tid, idle=calm and tid in self._copying)
        try:
            self._request("nice", lambda: os.setpriority(os.PRIO_PROCESS, tid, WRITE_BACK_NICE))
            self._request("ioprio", lambda: _set_ioprio(tid, calm and self._use_idle))
        except ProcessLookupError:
            self._tids.discard(tid)  # the thread ended without leaving

    def _set_cpu(self, tid: int, *, idle: bool) -> None:
        if not self._use_idle or "idle" in self._refused:
            return
        try:
            if idle:
                self._request("idle", lambda: _set_policy(tid, os.SCHED_IDLE))
            else:
                self._request("other", lambda: _set_policy(tid, os.SCHED_OTHER))
        except ProcessLookupError:
            self._tids.discard(tid)

    def _request(self, what: str, request: object) -> None:
        if what in self._refused:
            return
        try:
            request()  # type: ignore[operator]
        except ProcessLookupError:
            raise
        except (OSError, AttributeError) as exc:
            self._refused.add(what)
            if what == "other":
                self._refused.add("idle")  # never idle again: it could not be undone
            asked, instead = _REFUSED[what]
            log.warning("write-back threads: the OS refused %s (%s); %s", asked, exc, instead)


#: what a refusal means, for its log line: (what was asked, what happens instead)
_REFUSED = {
    "idle": ("SCHED_IDLE", f"they run at nice {WRITE_BACK_NICE}"),
    "other": ("leaving SCHED_IDLE", "they stay idle-class while behind, and are not made idle again"),
    "nice": (f"nice {WRITE_BACK_NICE}", "they run at the process's own priority"),
    "ioprio": ("an I/O priority class", "their I/O keeps the process's class"),
}

#: the process's write-back threads (the store threads of thread-run adapters)
WRITE_BACK = BackgroundThreads()
