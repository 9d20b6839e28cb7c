"""A prepare whose answer cannot be sent gives back what it took for the client.

``prepare_store`` reserves extents and ``prepare_retrieve`` read-locks chunks, both for
a client that learns of them only from the answer.  When that answer cannot go (the
client disconnected while its request was handled, or stopped reading its replies:
``RouterLoop.send`` answers False and counts ``reply_dropped``), nobody copies into or
out of those slots, nor commits them.  The reservation used to stay write-locked until
the write TTL -- other clients' stores of its chunks got no slots -- and its extents then
stayed fenced until a commit that never comes; the read locks stayed until shortly
before the lock TTL.  The failed send is injected (the send answers as it does for a
client that is gone): no timing.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from lmcache_plugin_lmcache_mp.wire import OPERATION_IDS
from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

GONE = Registration(instance_id=1000)
OTHER = Registration(instance_id=1001)


def one_chunk(request_id: str, worker_id: int = 0) -> Key:
    return Key(tokens_of(7), request_id, worker_id=worker_id, end=CHUNK_TOKENS)


def drop_next_reply(server: TiersServer, operation: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The next reply to ``operation`` is not sent, as to a client that is gone; returns
    the list the dropped reply's frames are put in."""
    router: Any = server.frontends[0].loop.router  # type: ignore[attr-defined]
    send = router.send
    op = msgspec.msgpack.encode(OPERATION_IDS[operation])
    dropped: list[Any] = []

    def failing_send(frames: Any) -> bool:
        if not dropped and frames[2] == op:
            dropped.append(frames)
            return False  # what RouterLoop.send answers when the client is gone
        return bool(send(frames))

    monkeypatch.setattr(router, "send", failing_send)
    return dropped


def l1(server: TiersServer) -> dict[str, Any]:
    return dict(server.storage.status()["l1"])


def test_a_store_whose_slots_never_reached_its_client_gives_its_reservation_back(
    mp_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropped = drop_next_reply(mp_server, "prepare_store", monkeypatch)
    with MPClient(mp_address(mp_server)) as gone, MPClient(mp_address(mp_server)) as other:
        shm = gone.register(GONE)["shm_name"]
        other.register(OTHER)
        assert gone.no_reply_to(gone.send("prepare_store", one_chunk("first").encode(), GONE.instance_id))
        assert dropped, "the prepare_store's reply was not the one dropped"
        # Nobody has those slots: the chunk is free for the next writer at once.
        assert l1(mp_server)["write_locked"] == 0
        [payload] = chunk_payloads(7, 1, OTHER.object_bytes)
        prepared = other.call("prepare_store", one_chunk("second").encode(), OTHER.instance_id)
        [slot] = prepared["context"]["slots"]
        other.segment(shm)[slot["offset"] : slot["offset"] + slot["length"]] = payload
        assert other.call("commit_store", one_chunk("second").encode(), OTHER.instance_id, b"") is True
        assert other.lookup(Key(tokens_of(7), "look", end=CHUNK_TOKENS)) == 1
        assert other.retrieve(one_chunk("third"), OTHER.instance_id, shm) == [payload]
    assert mp_stats(mp_server).store_keys_refused["reply_dropped"] == 1
    transfers: Any = mp_server.frontends[0].handlers.transfers  # type: ignore[attr-defined]
    assert transfers.writes.count() == 0 and not transfers.writes.fenced


def test_a_retrieve_whose_slots_never_reached_its_client_gives_its_read_locks_back(
    mp_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with MPClient(mp_address(mp_server)) as client:
        shm = client.register(GONE)["shm_name"]
        payloads = chunk_payloads(7, 1, GONE.object_bytes)
        assert client.store(one_chunk("store"), GONE.instance_id, payloads, shm)
        dropped = drop_next_reply(mp_server, "prepare_retrieve", monkeypatch)
        assert client.no_reply_to(
            client.send("prepare_retrieve", one_chunk("read").encode(), GONE.instance_id)
        )
        assert dropped, "the prepare_retrieve's reply was not the one dropped"
        assert l1(mp_server)["read_locks"] == 0
        # Unlocked, an unforced clear takes the chunk (a read-locked one it leaves).
        assert client.call("clear", False) is None
        assert l1(mp_server)["objects"] == 0
    transfers: Any = mp_server.frontends[0].handlers.transfers  # type: ignore[attr-defined]
    assert transfers.reads.count() == 0
