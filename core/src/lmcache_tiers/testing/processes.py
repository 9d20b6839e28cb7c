"""Freezing a server process for outage tests: SIGSTOP, then wait until it has stopped.

kill(2) only queues SIGSTOP: each thread stops when it next runs, and on a busy machine a
thread that has not yet could still answer a request sent right after the signal.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["freeze", "wait_stopped"]


def _thread_states(pid: int) -> list[str]:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
    return states


def wait_stopped(pid: int, timeout: float = 30.0) -> None:
    """Wait until every thread of ``pid`` is stopped; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = _thread_states(pid)
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout:g} s")


def freeze(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped."""
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid, timeout)
