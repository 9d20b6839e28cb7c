"""Requests waiting for a pool thread when the stop cancels the pool's queue are never
answered: each is counted once as ``mp_shutting_down``, as one arriving during the stop is
(pickled stores and retrieves count themselves: test_pickled_store_ends.py,
test_pickled_retrieve_at_stop.py)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from mpclient import (
    Key,
    MPClient,
    Registration,
    chunk_payloads,
    mp_address,
    pickled_chunks,
    tokens_of,
    wait_for,
)

REG = Registration()
CHUNK = REG.object_bytes
#: how long the stalled copy waits for the test at most (the test never relies on it)
STALL_LIMIT_S = 60.0


def test_a_queued_clear_the_stop_drops_is_counted_and_logged(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_mp_server(shm=False, allow_pickle=True, workers=1, shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    router, stats = frontend.loop.router, frontend.stats()
    lend = storage.lend
    go_on = threading.Event()

    def stalled(obj: Any, *, fill: bool = False) -> Any:
        if fill:
            go_on.wait(STALL_LIMIT_S)
        return lend(obj, fill=fill)

    monkeypatch.setattr(storage, "lend", stalled)
    try:
        with MPClient(mp_address(server)) as client, caplog.at_level(logging.WARNING):
            client.register(REG)
            slow = Key(tokens_of(42), "slow-store", worker_id=0)
            client.send(
                "commit_store", slow.encode(), REG.instance_id, pickled_chunks(chunk_payloads(42, 4, CHUNK))
            )
            wait_for(lambda: storage.status()["l1"]["write_locked"] == 4, "the slow store copying")
            client.send("clear", False)  # queued behind the stalled store
            wait_for(lambda: router.in_pool == 2, "the clear never reached the pool")
            frontend.stop()
            assert frontend.join(30)
    finally:
        go_on.set()
    assert stats.failures["mp_shutting_down"] == 2  # the store and the clear
    lines = [r.getMessage() for r in caplog.records if "given up at the stop" in r.getMessage()]
    assert any("clear" in line and "mp_shutting_down" in line for line in lines), lines
