"""The native front end counts every pool request its stop gives up on itself
(``shutting_down``): the router, which counts the requests no front end counted
(``pool_request_abandoned``), does not count them a second time."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from native_stop import STALL_LIMIT_S, dealer, wait_for

from lmcache_tiers.router import ABANDONED_REASON
from lmcache_tiers.wire import protocol as p


@pytest.mark.parametrize("force", [False, True], ids=["drain_deadline", "forced"])
def test_a_clear_running_past_the_stop_is_counted_once(
    make_server: Any, monkeypatch: pytest.MonkeyPatch, force: bool
) -> None:
    server = make_server(frontends=[{"type": "native", "pool_workers": 1}], shutdown_timeout_s=0.2)
    frontend, storage = server.frontends[0], server.storage
    clear = storage.clear
    go_on = threading.Event()

    def stalled(*, force: bool = False) -> int:
        go_on.wait(STALL_LIMIT_S)
        return int(clear(force=force))

    monkeypatch.setattr(storage, "clear", stalled)
    try:
        with dealer(server.endpoint) as sock:
            sock.send(p.encoder.encode(p.Clear(1, "")))
            wait_for(lambda: frontend.rpc.router.in_pool == 1, "the clear running on the pool")
            frontend.stop(force=force)
            assert frontend.join(30)
    finally:
        go_on.set()
    stats = frontend.stats()
    assert stats.failures["shutting_down"] == 1
    assert ABANDONED_REASON not in stats.failures
