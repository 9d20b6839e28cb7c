"""A request running on the pool when the stop ends (a clear past the drain deadline) is
never answered: the router counts it once (``pool_request_abandoned``), and one the
front end gave up on in the queue is counted by the front end alone (``mp_shutting_down``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from mpclient import MPClient, mp_address, wait_for

from lmcache_tiers.router import ABANDONED_REASON

#: how long the stalled clear waits for the test at most (the test never relies on it)
STALL_LIMIT_S = 60.0


@pytest.mark.parametrize("force", [False, True], ids=["drain_deadline", "forced"])
def test_a_clear_running_past_the_stop_is_counted_once_as_abandoned(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch, force: bool
) -> None:
    server = make_mp_server(workers=1, shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    router, stats = frontend.loop.router, frontend.stats()
    clear = storage.clear
    running, go_on = threading.Event(), threading.Event()

    def stalled(*, force: bool = False) -> int:
        running.set()
        go_on.wait(STALL_LIMIT_S)
        return int(clear(force=force))

    monkeypatch.setattr(storage, "clear", stalled)
    try:
        with MPClient(mp_address(server)) as client:
            client.send("clear", False)
            assert running.wait(STALL_LIMIT_S)
            client.send("clear", False)  # queued behind the running one
            wait_for(lambda: router.in_pool == 2, "the second clear never reached the pool")
            frontend.stop(force=force)
            assert frontend.join(30)
    finally:
        go_on.set()
    assert stats.failures[ABANDONED_REASON] == 1  # the running clear
    assert stats.failures["mp_shutting_down"] == 1  # the queued one, counted by the front end
