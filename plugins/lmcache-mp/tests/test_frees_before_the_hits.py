"""``free_lookup_locks`` calls that come while their lookup's prefetch still runs are kept
until the hit count is known, in no more room than the lookup's chunks.

Each such call used to be kept as its own entry: a client repeating it while a slow L2
held the prefetch (up to half the lock TTL) grew the server's memory by an entry per
call, and the loop thread then went through every one of them.  Freeing a chunk twice
frees it once, so what is kept is which chunks were freed; they are still released when
the hit count comes.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from mp_slow_l2 import SLOW_L2
from mpclient import (
    CHUNK_TOKENS,
    Key,
    MPClient,
    Registration,
    chunk_payloads,
    mp_address,
    tokens_of,
    wait_for,
)

REG = Registration()
#: chunks of the request (tokens_of's 1025 tokens)
CHUNKS = 4
#: free_lookup_locks calls sent while the prefetch runs
FREES = 1000


def test_repeated_early_frees_take_no_more_room_than_the_chunks(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_mp_server(adapters=SLOW_L2, lookup_wait_ms=0)
    storage = server.storage
    lookups: Any = server.frontends[0].handlers.lookups  # type: ignore[attr-defined]
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        tokens = tokens_of(7)
        payloads = chunk_payloads(7, CHUNKS, REG.object_bytes)
        assert client.store(Key(tokens, "s", worker_id=0), REG.instance_id, payloads, shm)
        assert storage.flush(timeout=60)
        assert client.call("clear", True) is None  # in L2 alone: the lookup's prefetch loads them

        # The prefetch reports to the front end only once the test says so.
        reported = threading.Event()
        query = storage.query_prefetch
        monkeypatch.setattr(
            storage, "query_prefetch", lambda handle: query(handle) if reported.is_set() else None
        )

        assert client.call("lookup", Key(tokens, "r").encode(), 1) is None
        first_two = Key(tokens, "r", end=2 * CHUNK_TOKENS).encode()
        for _ in range(FREES):
            client.send("free_lookup_locks", first_two, 1)
        assert client.call("noop") == "OK"  # handled in order: every free was handled before
        job = lookups._job("r")
        assert job.hits is None  # still running
        assert len(job.early_frees) <= CHUNKS

        reported.set()
        wait_for(lambda: job.hits is not None, "the prefetch's report")
        assert job.hits == CHUNKS
        # The two freed chunks' locks went at the report, the others are the request's.
        assert storage.status()["l1"]["read_locks"] == CHUNKS - 2
        assert client.call("query_prefetch_status", "r") == CHUNKS
        assert client.call("end_session", "r") is None
        assert storage.status()["l1"]["read_locks"] == 0
