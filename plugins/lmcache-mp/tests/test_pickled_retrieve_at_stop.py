"""A pickled ``prepare_retrieve`` read-locks its chunks on the loop thread and copies them
out on the pool, which releases the locks.  One the stop drops from the pool's queue
before it ran never copies: its locks are given back at the stop, and it is counted as
not answered (``mp_shutting_down``), as a pickled store the stop gives up on is."""

from __future__ import annotations

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


def test_a_queued_pickled_retrieve_the_stop_drops_gives_back_its_locks_and_is_counted(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_mp_server(shm=False, allow_pickle=True, workers=1, shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    router, stats = frontend.loop.router, frontend.stats()
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        stored = Key(tokens_of(40), "stored", worker_id=0)
        chunks = pickled_chunks(chunk_payloads(40, 4, CHUNK))
        assert client.call("commit_store", stored.encode(), REG.instance_id, chunks) is True
        with stalled_fills(storage, monkeypatch):
            send_stalled_store(client, storage, 41, "slow-store")
            # queued behind the stalled store, holding the read locks of its four chunks
            client.send(
                "prepare_retrieve", Key(tokens_of(40), "queued", worker_id=0).encode(), REG.instance_id
            )
            wait_for(lambda: router.in_pool == 2, "the retrieve never reached the pool")
            assert storage.status()["l1"]["read_locks"] == 4
            frontend.stop()
            assert frontend.join(30)
    assert storage.status()["l1"]["read_locks"] == 0
    assert stats.failures["mp_shutting_down"] == 2  # the store and the retrieve
