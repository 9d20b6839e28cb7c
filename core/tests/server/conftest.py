"""In-process servers (real StorageManager, L1 only unless told) on a thread; end-to-end
tests with separate processes live in tests/server."""

import threading
from collections.abc import Callable

import pytest

from lmcache_tiers.testing.server import make_server, server

__all__ = ["make_server", "new_threads", "server"]


@pytest.fixture
def new_threads() -> Callable[[str], list[threading.Thread]]:
    """The running threads whose names start with a prefix that were not running when the
    test began: another test file on the same worker process may have left its own."""
    before = set(threading.enumerate())

    def started(prefix: str) -> list[threading.Thread]:
        return [
            thread
            for thread in threading.enumerate()
            if thread.name.startswith(prefix) and thread not in before
        ]

    return started
