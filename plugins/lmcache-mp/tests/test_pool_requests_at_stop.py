"""Requests waiting for a pool thread when the stop cancels the pool's queue are never
answered: each is counted once as ``mp_shutting_down``, as one arriving during the stop is
(pickled stores and retrieves count themselves: test_pickled_store_ends.py,
test_pickled_retrieve_at_stop.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from mpclient import MPClient, Registration, mp_address, send_stalled_store, stalled_fills, wait_for

REG = Registration()


def test_a_queued_clear_the_stop_drops_is_counted_and_logged(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_mp_server(shm=False, allow_pickle=True, workers=1, shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    router, stats = frontend.loop.router, frontend.stats()
    with (
        stalled_fills(storage, monkeypatch),
        MPClient(mp_address(server)) as client,
        caplog.at_level(logging.WARNING),
    ):
        client.register(REG)
        send_stalled_store(client, storage, 42, "slow-store")
        client.send("clear", False)  # queued behind the stalled store
        wait_for(lambda: router.in_pool == 2, "the clear never reached the pool")
        frontend.stop()
        assert frontend.join(30)
    assert stats.failures["mp_shutting_down"] == 2  # the store and the clear
    lines = [r.getMessage() for r in caplog.records if "given up at the stop" in r.getMessage()]
    assert any("clear" in line and "mp_shutting_down" in line for line in lines), lines
