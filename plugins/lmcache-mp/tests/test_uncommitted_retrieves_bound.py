"""What one connection's retrieves prepared and not committed may make the server hold.

Each shared-memory ``prepare_retrieve`` keeps a record of its read locks (its keys) until
its ``commit_retrieve``, or until the sweep gives them back shortly before the lock TTL
(300 s by default).  A client preparing retrieves without committing them (a hung
engine, a bug) grew the server's memory by a record per request for as long as the TTL:
nothing bounded them but time.  A connection whose uncommitted retrieves name
``max_request_keys`` keys or more now has its next one answered a miss (the engine
recomputes), counted and logged; one retrieve is always served.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from lmcache_plugin_lmcache_mp.state import PendingTransfers, Transfer
from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, mp_address, tokens_of

from lmcache_tiers.plugin import ObjectKey

WRITER = Registration(instance_id=1000)
READER = Registration(instance_id=1001)
SIZE = WRITER.object_bytes
#: two retrieves of the two-chunk range reach it
MAX_REQUEST_KEYS = 4
PAYLOADS = [b"\x01" * SIZE, b"\x02" * SIZE]


def two_chunks(request_id: str) -> Key:
    return Key(tokens_of(1, 2 * CHUNK_TOKENS), request_id, worker_id=0)


def prepare(client: MPClient, key: Key, registration: Registration = WRITER) -> bool:
    served: bool = client.call("prepare_retrieve", key.encode(), registration.instance_id)["success"]
    return served


def test_a_connection_whose_uncommitted_retrieves_reach_the_bound_misses(
    make_mp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lmcache_plugin_lmcache_mp")
    server = make_mp_server(max_request_keys=MAX_REQUEST_KEYS)
    transfers: Any = server.frontends[0].handlers.transfers  # type: ignore[attr-defined]
    with MPClient(mp_address(server)) as client, MPClient(mp_address(server)) as other:
        shm = client.register(WRITER)["shm_name"]
        other.register(READER)
        assert client.store(two_chunks("store"), WRITER.instance_id, PAYLOADS, shm)
        read = two_chunks("read")
        assert prepare(client, read) and prepare(client, read)
        # Its uncommitted retrieves name 4 keys: the next one misses, nothing more is held.
        assert not prepare(client, read)
        assert not prepare(client, two_chunks("another"))
        assert transfers.reads.count() == 2
        stats = mp_stats(server)
        assert stats.failures["mp_retrieves_uncommitted"] == 2
        assert "retrieves not committed yet name 4 keys (bound 4, max_request_keys)" in caplog.text
        # Another connection is not held up by it.
        assert other.retrieve(two_chunks("other"), READER.instance_id, shm) == PAYLOADS
        # A commit gives its share back: the connection is served again.
        assert client.call("commit_retrieve", read.encode(), WRITER.instance_id) is True
        assert prepare(client, read)
        assert transfers.reads.count() == 2
        for _ in range(2):
            assert client.call("commit_retrieve", read.encode(), WRITER.instance_id) is True
        assert transfers.reads.count() == 0
        assert client.retrieve(two_chunks("again"), WRITER.instance_id, shm) == PAYLOADS


def test_every_way_a_transfer_stops_pending_gives_back_its_connections_keys() -> None:
    """The count the bound reads follows the transfers whatever ends them: a commit, an
    undelivered reply, the sweep (before the deadline, or past it), an unregister, the stop."""
    keys = [ObjectKey("m", 0, bytes([index]) * 32) for index in range(3)]
    pending = PendingTransfers()

    def add(request_id: str, deadline: float, peer: bytes = b"a") -> Transfer:
        transfer = Transfer(list(keys), deadline, request_id, peer=peer)
        pending.add(1, keys, transfer)
        return transfer

    add("commit", 100.0)
    undelivered = add("undelivered", 100.0)
    add("due", 10.0)
    add("expired", 1.0)
    add("other", 100.0, peer=b"b")
    assert pending.keys_of(b"a") == 12 and pending.keys_of(b"b") == 3
    assert pending.pop(1, "commit", keys, 5.0, b"a") is not None
    assert pending.discard(undelivered)
    assert len(pending.take_due(5.0, 6.0)) == 1
    assert len(pending.expire(5.0)) == 1
    assert pending.keys_of(b"a") == 0
    add("unregistered", 100.0)
    add("pop-expired", 1.0)
    assert pending.pop(1, "pop-expired", keys, 5.0, b"a") is None  # past its deadline
    assert len(pending.pop_instance(1, b"a")) == 1
    assert pending.keys_of(b"a") == 0 and pending.keys_of(b"b") == 3
    pending.pop_all()
    assert pending.keys_of(b"b") == 0
