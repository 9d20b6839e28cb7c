"""Threads a test started: a worker process runs test files one after another, and a thread
another file left running (a copy helper, an adapter's worker being closed) has the same
name as the test's own; and bounded waits for tests, so that a stuck one fails with a message
naming what it awaited instead of hanging its pytest worker until the suite's timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

__all__ = ["DEADLINE_S", "joined", "new_threads", "wait_until"]

# Generous: a bound on a wait that should end in milliseconds, never a measure of speed (on a
# loaded CI machine a poll may take seconds, and a stuck one should still cost far less than
# pytest's 600 s timeout).
DEADLINE_S = 30.0


def wait_until(
    condition: Callable[[], object], what: str, timeout: float = DEADLINE_S, interval: float = 0.01
) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def joined(thread: threading.Thread, what: str, timeout: float = DEADLINE_S) -> None:
    """Join ``thread``; fail naming ``what`` it was doing when it is still running after
    ``timeout``.  Start it as a daemon, so that one left behind cannot hold up the exit of
    the worker process either."""
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"thread {thread.name} still running after {timeout:g} s: {what}")


@pytest.fixture
def new_threads() -> Callable[[str], list[threading.Thread]]:
    """The running threads whose names start with a prefix that were not running when the
    test began.  Import it into a conftest to use it."""
    before = set(threading.enumerate())

    def started(prefix: str) -> list[threading.Thread]:
        return [
            thread
            for thread in threading.enumerate()
            if thread.name.startswith(prefix) and thread not in before
        ]

    return started
