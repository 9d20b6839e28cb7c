"""The helper threads that take a load's share of its checksums, once shut down."""

from __future__ import annotations

import pytest
from lmcache_plugin_mooncake.helpers import HelperThreads


def test_work_submitted_after_shutdown_is_refused_not_left_waiting_forever() -> None:
    # A load left running inside Mooncake when close gave up on it reaches its checksums
    # after the helpers were shut down: its share handed to threads that have ended would
    # never run, and the load would wait for it forever (and the process's exit with it).
    helpers = HelperThreads("test-verify", 2)
    assert helpers.submit(sum, [1, 2]).result() == 3
    helpers.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        helpers.submit(sum, [1, 2])


def test_work_submitted_before_shutdown_is_done_by_then() -> None:
    helpers = HelperThreads("test-verify", 2)
    futures = [helpers.submit(sum, [part, 1]) for part in range(8)]
    helpers.shutdown()
    assert all(future.done() for future in futures)
    assert [future.result() for future in futures] == [part + 1 for part in range(8)]
