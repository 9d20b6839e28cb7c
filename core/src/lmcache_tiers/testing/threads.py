"""Threads a test started: a worker process runs test files one after another, and a thread
another file left running (a copy helper, an adapter's worker being closed) has the same
name as the test's own."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

__all__ = ["new_threads"]


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
