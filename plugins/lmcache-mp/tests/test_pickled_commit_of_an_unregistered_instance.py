"""A pickled ``commit_store`` of an instance no longer registered still gives back its
connection's reservation of the range.

A client that cannot map the segment gets slots from ``prepare_store`` all the same, and
sends its chunks pickled with the commit (LMCache's fallback).  When the instance is no
longer registered by then (reaped, or unregistered by the connection whose registration
was in force), that commit is refused, as by LMCache's server -- but it still says the
client will never copy into the slots, as the shared-memory commit of such an instance
does.  The reservation used to stay: write-locked until the write TTL, then fenced until a
commit accepted or the client's exit, for good when that could not be told.
"""

from __future__ import annotations

from typing import Any

from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, mp_address, tokens_of, wait_for

from lmcache_tiers.server.app import TiersServer

REG = Registration()
UNREGISTER = "unregister_kv_cache_engine_driven_context"
#: what a pickled commit carries (never read: the instance is refused first)
PICKLED = b"\x80\x04]\x94."


def one_chunk(request_id: str) -> Key:
    return Key(tokens_of(6), request_id, worker_id=0, end=CHUNK_TOKENS)


def l1(server: TiersServer) -> dict[str, Any]:
    return dict(server.storage_status()["l1"])


def prepare_then_lose_the_registration(writer: MPClient, owner: MPClient) -> None:
    writer.register(REG)
    owner.register(REG)  # the same id and layout: now the owner's registration
    prepared = writer.call("prepare_store", one_chunk("fallback").encode(), REG.instance_id)
    assert len(prepared["context"]["slots"]) == 1
    assert owner.call(UNREGISTER, REG.instance_id) is None


def test_a_refused_pickled_commit_gives_the_reservation_back(mp_server: TiersServer) -> None:
    address = mp_address(mp_server)
    with MPClient(address) as writer, MPClient(address) as owner:
        prepare_then_lose_the_registration(writer, owner)
        assert l1(mp_server)["write_locked"] == 1  # another connection's: left alone
        assert writer.unanswered("commit_store", one_chunk("fallback").encode(), REG.instance_id, PICKLED)
        assert writer.call("noop") == "OK"  # handled in order: the commit was handled before
        assert mp_stats(mp_server).failures["mp_unregistered_instance"] == 1
        assert l1(mp_server)["write_locked"] == 0
        assert l1(mp_server)["objects"] == 0
        assert mp_stats(mp_server).store_keys_refused["unregistered"] == 1
    transfers: Any = mp_server.frontends[0].handlers.transfers  # type: ignore[attr-defined]
    assert transfers.writes.count() == 0


def test_a_refused_pickled_commit_lifts_the_fence(make_mp_server: Any) -> None:
    # Clients in the server's own process: no exit of theirs lifts a fence.
    server = make_mp_server(l1_write_ttl_s=1.0, l1_lock_ttl_s=1.0)
    transfers: Any = server.frontends[0].handlers.transfers
    address = mp_address(server)
    with MPClient(address) as writer, MPClient(address) as owner:
        prepare_then_lose_the_registration(writer, owner)
        wait_for(
            lambda: bool(transfers.writes.fenced) and l1(server)["leases"]["fenced_extents"] == 1,
            "the expired reservation fenced",
        )
        assert writer.unanswered("commit_store", one_chunk("fallback").encode(), REG.instance_id, PICKLED)
        assert writer.call("noop") == "OK"
        assert l1(server)["leases"]["fenced_extents"] == 0
        assert not transfers.writes.fenced
