"""Write-back runs as background work: store threads at the lowest CPU priority, and the
GIL handed over quickly while the store controller runs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from l2_backends import open_dict

from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.controllers.store import GIL_SWITCH_S, StoreController
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l2.background import WRITE_BACK, BackgroundThreads, get_ioprio, ioprio_value
from lmcache_tiers.l2.runners import WRITE_BACK_NICE
from lmcache_tiers.l2.workers import BatchWorkers
from lmcache_tiers.policies import StorePolicy


def nice_of(thread: threading.Thread) -> int:
    """The thread's nice value, from /proc (field 19 of its stat line)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[16])


@pytest.fixture
def switch_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc for thread priorities")
def test_store_threads_run_at_the_lowest_priority_and_the_others_do_not(
    new_threads: Callable[[str], list[threading.Thread]],
) -> None:
    adapter = open_dict()
    try:
        workers = {t.name: t for t in new_threads("l2-0:t-")}
        stores = [t for name, t in workers.items() if "-store-" in name]
        others = [t for name, t in workers.items() if "-store-" not in name]
        assert stores and others
        assert {nice_of(t) for t in stores} == {max(os.nice(0), WRITE_BACK_NICE)}
        assert {nice_of(t) for t in others} == {os.nice(0)}
    finally:
        adapter.close()


class _Everywhere(StorePolicy):
    def select_store_targets(self, keys, adapters):  # type: ignore[no-untyped-def]
        return {adapter.index: list(keys) for adapter in adapters}

    def select_l1_deletions(self, keys):  # type: ignore[no-untyped-def]
        return []


def test_the_store_controller_shortens_the_gil_switch_interval_only_with_adapters(
    switch_interval: float,
) -> None:
    sys.setswitchinterval(0.005)
    l1 = L1Manager(16 << 20, prefault=False)
    try:
        idle = StoreController(l1, [], _Everywhere(), EngineStats(0))
        idle.start()
        idle.stop()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        adapter = open_dict()
        try:
            busy = StoreController(l1, [AdapterSlot(0, "dict", adapter)], _Everywhere(), EngineStats(0))
            busy.start()
            busy.stop()
            assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
        finally:
            adapter.close()
    finally:
        l1.close()


# -- idle while write-back keeps up (l2/background.py) ----------------------------------


def policy_of(tid: int) -> int:
    return os.sched_getscheduler(tid)


needs_idle = pytest.mark.skipif(
    not (hasattr(os, "SCHED_IDLE") and WRITE_BACK.uses_idle),
    reason="this process may not leave SCHED_IDLE again (needs CAP_SYS_NICE or RLIMIT_NICE >= 10)",
)


@needs_idle
def test_store_threads_take_idle_io_and_nice_10_until_write_back_is_hurried(
    new_threads: Callable[[str], list[threading.Thread]],
) -> None:
    adapter = open_dict()
    try:
        workers = new_threads("l2-0:t-")
        stores = [t.native_id for t in workers if "-store-" in t.name]
        others = [t.native_id for t in workers if "-store-" not in t.name]
        assert stores and others
        # the threads set their own priority once started: wait until the last step is done
        idle_io = {ioprio_value(idle=True)}
        deadline = time.monotonic() + 10
        while {get_ioprio(tid) for tid in stores} != idle_io and time.monotonic() < deadline:
            time.sleep(0.001)
        assert {get_ioprio(tid) for tid in stores} == idle_io
        # idle CPU class only inside copies: their Python runs at nice 10 (GIL holders)
        assert {policy_of(tid) for tid in stores} == {os.SCHED_OTHER}
        assert {nice_of_tid(tid) for tid in stores} == {max(os.nice(0), WRITE_BACK_NICE)}
        assert os.SCHED_IDLE not in {policy_of(tid) for tid in others}
        WRITE_BACK.hurry(True)
        try:
            assert {policy_of(tid) for tid in stores} == {os.SCHED_OTHER}
            assert {get_ioprio(tid) for tid in stores} == {ioprio_value(idle=False)}
            assert {nice_of_tid(tid) for tid in stores} == {max(os.nice(0), WRITE_BACK_NICE)}
        finally:
            WRITE_BACK.hurry(False)
        assert {get_ioprio(tid) for tid in stores} == idle_io
        assert WRITE_BACK.cpu_s() is not None
    finally:
        adapter.close()


def _in_thread(work: Callable[[], object]) -> object:
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(work()))
    thread.start()
    thread.join(10)
    return results[0]


@needs_idle
def test_copies_run_idle_class_while_write_back_keeps_up_and_at_nice_10_while_hurried() -> None:
    table = BackgroundThreads(use_idle=True)

    def policy() -> int:
        return os.sched_getscheduler(threading.get_native_id())

    def work() -> list[int]:
        seen = []
        with table.copying():  # not a write-back thread yet: left alone
            seen.append(policy())
        table.enter()
        seen.append(policy())
        with table.copying():
            seen.append(policy())
            with table.copying():  # nested: still idle, and the outer block decides
                seen.append(policy())
            seen.append(policy())
            table.hurry(True)  # a hurry in the middle of a copy takes effect at once
            seen.append(policy())
        with table.copying():  # hurried: copies at nice 10 too
            seen.append(policy())
        table.hurry(False)
        with table.copying():
            seen.append(policy())
        seen.append(policy())
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        table.leave()
        return seen

    idle, other = os.SCHED_IDLE, os.SCHED_OTHER
    assert _in_thread(work) == [other, other, idle, idle, idle, other, other, idle, other, WRITE_BACK_NICE]


def nice_of_tid(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])


# An unprivileged process: it may enter SCHED_IDLE but never leave it, so the threads stay
# at nice 10 -- and a table forced to use idle logs the refusal once, then stops trying.
_UNPRIVILEGED = r"""
import logging, os, resource, sys, threading
from lmcache_tiers.l2.background import BackgroundThreads, may_leave_idle
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
assert not may_leave_idle()
def run(table, report):
    ready, done = threading.Event(), threading.Event()
    def work():
        table.enter(); ready.set(); done.wait(); table.leave()
    thread = threading.Thread(target=work); thread.start(); ready.wait()
    report(thread.native_id)
    done.set(); thread.join()
def policy(tid):
    print("policy", os.sched_getscheduler(tid) == os.SCHED_IDLE, flush=True)
def copies(table):
    table.enter()
    for _ in range(3):
        with table.copying():
            policy(threading.get_native_id())
    policy(threading.get_native_id())
    table.leave()
for table in (BackgroundThreads(), BackgroundThreads(use_idle=True)):
    thread = threading.Thread(target=copies, args=(table,)); thread.start(); thread.join()
"""


@needs_idle
def test_an_unprivileged_process_keeps_nice_10_and_logs_a_refusal_once() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to start an unprivileged child")
    done = subprocess.run([sys.executable, "-c", _UNPRIVILEGED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("policy")]
    refusals = [line for line in done.stdout.splitlines() if "refused leaving SCHED_IDLE" in line]
    # default table: never idle; forced: idle in its first copy, then stuck there (the way
    # back refused, logged once) and never asked for again
    assert lines[:4] == ["policy False"] * 4
    assert lines[4:] == ["policy True"] * 4
    assert len(refusals) == 1, done.stdout


def _helper_nice(background: bool) -> tuple[int, int]:
    """(nice of the helper thread that took a row, nice of the caller) for one two-row map."""
    workers = BatchWorkers(2, "test-batch", background=background)
    both = threading.Barrier(2, timeout=10)  # each thread must take one row

    def work(_row: int) -> tuple[int, int]:
        both.wait()
        return threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    try:
        caller = threading.get_native_id()
        rows = workers.map(work, [0, 1])
        helper = next(nice for tid, nice in rows if tid != caller)
        return helper, os.getpriority(os.PRIO_PROCESS, caller)
    finally:
        workers.shutdown()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc for thread priorities")
def test_the_helpers_of_a_store_batch_take_the_write_back_priority_and_load_helpers_do_not() -> None:
    helper, caller = _helper_nice(background=True)
    assert helper == max(os.nice(0), WRITE_BACK_NICE)
    assert caller == os.nice(0)  # the calling thread is left as it was
    helper, _caller = _helper_nice(background=False)
    assert helper == os.nice(0)
