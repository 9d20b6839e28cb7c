"""The request path runs at a better nice level than the process's other threads where the
OS allows it, and as started (with one log line) where it does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmcache_tiers.server.priority import REQUEST_NICE

# In a child of its own: the serving thread must be the main thread, and nice values are
# easier to raise than to lower back for an unprivileged test process.
_CHILD = r"""
import logging, os, resource, sys, threading
from lmcache_tiers.server.priority import request_threads_favoured
if sys.argv[1] == "unprivileged":
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="log: %(message)s")
def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
before = nice()
seen = []
with request_threads_favoured() as favoured:
    thread = threading.Thread(target=lambda: seen.append(nice()))
    thread.start(); thread.join()
print("favoured", favoured, "thread", seen[0], "before", before, "after", nice(), flush=True)
"""


def run_child(mode: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a nice value needs root (CAP_SYS_NICE)")
def test_threads_started_by_the_serving_thread_run_at_the_request_nice() -> None:
    [line] = run_child("root")
    assert line == f"favoured True thread {REQUEST_NICE} before {os.nice(0)} after {os.nice(0)}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start an unprivileged child")
def test_where_the_os_refuses_the_threads_keep_their_nice_and_one_line_says_so() -> None:
    lines = run_child("unprivileged")
    nice = os.nice(0)
    assert lines[-1] == f"favoured False thread {nice} before {nice} after {nice}"
    refusals = [line for line in lines if line.startswith("log: ") and "refused" in line]
    assert len(refusals) == 1, lines


# A front end built before the serving thread raised its priority (as the server does):
# the ZeroMQ I/O thread its socket started takes the priority of the thread that starts it.
_FRONTEND_CHILD = r"""
import os, threading
from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import RouterLoop
from lmcache_tiers.server.priority import request_threads_favoured, threads_named, thread_ids
def nice(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)
loop = RouterLoop("tcp://127.0.0.1:0", name="t", stats=FrontendStats(), pool_workers=1,
                  max_frame_bytes=1 << 20, sweep_interval_s=0.05, drain_timeout_s=1.0)
io_threads = threads_named(thread_ids(), "ZMQbg/IO", wait_s=30)
before = [nice(tid) for tid in io_threads]
with request_threads_favoured():
    loop.start(lambda: loop.socket.poll(10) and None, sweep=lambda now: None, on_drain=lambda: None,
               on_shutdown=lambda: None, on_failure=lambda exc: None)
print("before", before, "after", [nice(tid) for tid in io_threads], flush=True)
loop.request_stop(force=True)
loop.join(10)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a nice value needs root (CAP_SYS_NICE)")
def test_a_front_ends_zeromq_io_thread_runs_at_the_request_nice() -> None:
    done = subprocess.run([sys.executable, "-c", _FRONTEND_CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    nice = os.nice(0)
    assert done.stdout.splitlines()[-1] == f"before [{nice}] after [{REQUEST_NICE}]"
