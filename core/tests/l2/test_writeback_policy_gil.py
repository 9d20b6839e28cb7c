"""A write-back thread changes its scheduling class without holding the GIL."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import pytest

from lmcache_tiers.l2 import background
from lmcache_tiers.l2.background import BackgroundThreads, may_leave_idle

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or not may_leave_idle(), reason="needs SCHED_IDLE and leave to go back"
)


def test_going_idle_class_and_back_releases_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.sched_setscheduler keeps the GIL: a thread made idle-class is preempted inside the
    call by any thread that wants its core, and the request threads then waited for the GIL
    until that core was free again.  The change goes
    through the C library by ctypes, which releases the GIL for the call, and still takes
    effect both ways."""
    through_os: list[tuple[Any, ...]] = []
    real = os.sched_setscheduler

    def noting(*args: Any) -> None:
        through_os.append(args)
        real(*args)

    monkeypatch.setattr(os, "sched_setscheduler", noting)
    binding = background._sched_setscheduler
    assert binding is not None
    assert not type(binding)._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]  # a CDLL call: without the GIL
    threads = BackgroundThreads(use_idle=True)
    seen: dict[str, int] = {}

    def write_back() -> None:
        threads.enter()
        try:
            with threads.copying():
                seen["copying"] = os.sched_getscheduler(0)
            seen["after"] = os.sched_getscheduler(0)
        finally:
            threads.leave()

    worker = threading.Thread(target=write_back)
    worker.start()
    worker.join()
    assert seen == {"copying": os.SCHED_IDLE, "after": os.SCHED_OTHER}
    assert through_os == []


def test_a_thread_that_ended_is_forgotten_and_idle_is_not_taken_as_refused() -> None:
    """The C library's ESRCH is a ProcessLookupError, as os raises it: the table forgets
    the thread instead of logging a refusal and never using idle again."""
    threads = BackgroundThreads(use_idle=True)
    gone = (1 << 22) + 1  # above the largest pid_max: no thread has this id
    with pytest.raises(ProcessLookupError):
        background._set_policy(gone, os.SCHED_OTHER)
    threads._tids.add(gone)
    threads._copying.add(gone)  # as a thread that ended inside a copy
    threads.hurry(True)
    assert gone not in threads._tids
    assert threads.uses_idle and threads._refused == set()
