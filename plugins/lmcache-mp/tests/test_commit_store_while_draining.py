"""A ``commit_store`` that arrives while the front end drains is refused, as every request
then is; its chunks are never stored, so its keys are counted as refused
(``store_keys_refused["shutting_down"]``) and its line names the operation and request."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from mpclient import (
    Key,
    MPClient,
    Registration,
    chunk_payloads,
    mp_address,
    pickled_chunks,
    send_stalled_store,
    stalled_fills,
    tokens_of,
    wait_for,
)

REG = Registration()
CHUNK = REG.object_bytes
#: how long the drain may last at most: until the test lets the stalled copy go on
DRAIN_LIMIT_S = 60.0


def test_a_pickled_commit_store_arriving_during_the_drain_counts_its_keys_and_names_its_request(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # One store stalls in its copy, so the drain lasts until the test lets it go on.
    server = make_mp_server(shm=False, allow_pickle=True, workers=1, shutdown_timeout_s=DRAIN_LIMIT_S)
    storage, frontend = server.storage, server.frontends[0]
    router, stats = frontend.loop.router, frontend.stats()
    try:
        with (
            stalled_fills(storage, monkeypatch),
            MPClient(mp_address(server)) as client,
            caplog.at_level(logging.WARNING),
        ):
            client.register(REG)
            send_stalled_store(client, storage, 30, "in-flight")
            frontend.stop()
            wait_for(lambda: router.draining, "the front end never began to drain")
            late = Key(tokens_of(31), "late-store", worker_id=0)
            pickled = pickled_chunks(chunk_payloads(31, 4, CHUNK))
            assert client.unanswered("commit_store", late.encode(), REG.instance_id, pickled)
            wait_for(lambda: stats.failures["mp_shutting_down"] == 1, "the late store was not counted")
            assert stats.store_keys_refused["shutting_down"] == 4
            lines = [r.getMessage() for r in caplog.records if "late-store" in r.getMessage()]
            assert lines and "commit_store" in lines[0] and "mp_shutting_down" in lines[0]
    finally:
        assert frontend.join(30)  # the stalled copy went on as the block ended
    assert stats.store_chunks == 4  # the first store, finished within the drain
    assert stats.store_keys_refused["shutting_down"] == 4
