"""A routing identity is the peer's to choose (``ZMQ_ROUTING_ID``), and free again once its
connection drops: another connection under that identity holds none of the first one's
reservations, fences or registrations, so it can neither make extents nobody copied into
readable as their keys nor lift the fence of a copy the first client may still be making."""

from __future__ import annotations

from typing import Any

import zmq
from mp_counts import mp_stats
from mpclient import (
    Key,
    MPClient,
    Registration,
    chunk_payloads,
    mp_address,
    one_chunk,
    wait_for,
)
from writer_processes import fenced_extents

from lmcache_tiers.server.app import TiersServer

REG = Registration()
IDENTITY = b"fixed-worker"


def client_named(url: str, identity: bytes) -> MPClient:
    """A client connected under ``identity``, once the ROUTER took it: while an earlier
    connection under it is not known to have dropped, the ROUTER turns a new one away
    and the DEALER connects again, losing what it had sent."""
    client = MPClient(url)
    client.socket.close(0)
    client.socket = client.context.socket(zmq.DEALER)
    client.socket.setsockopt(zmq.LINGER, 0)
    client.socket.setsockopt(zmq.ROUTING_ID, identity)
    client.socket.connect(client.url)
    wait_for(lambda: client.receive(client.send("noop"), 200) == "OK", f"connected as {identity!r}")
    return client


def prepare_and_drop(url: str, key: Key) -> None:
    """A client under IDENTITY reserves one chunk, then drops without copying into it."""
    with client_named(url, IDENTITY) as victim:
        victim.register(REG)
        prepared = victim.call("prepare_store", key.encode(), REG.instance_id)["context"]
        assert len(prepared["slots"]) == 1


def test_a_connection_under_a_dropped_ones_identity_cannot_commit_its_reservation(
    mp_server: TiersServer,
) -> None:
    url = mp_address(mp_server)
    victim_key = one_chunk(7, "victim")
    prepare_and_drop(url, victim_key)
    with client_named(url, IDENTITY) as thief:
        assert thief.call("commit_store", victim_key.encode(), REG.instance_id, b"") is False
        # registering under the identity holds none of the first connection's reservations
        thief.register(REG)
        assert thief.call("commit_store", victim_key.encode(), REG.instance_id, b"") is False
    assert mp_stats(mp_server).failures["mp_commit_without_reservation"] == 2
    with MPClient(url) as honest:
        shm = honest.register(REG)["shm_name"]
        assert honest.call("prepare_retrieve", victim_key.encode(), REG.instance_id)["success"] is False
        assert honest.call("commit_retrieve", victim_key.encode(), REG.instance_id) is True
        key = one_chunk(8, "honest")
        payload = chunk_payloads(8, 1, REG.object_bytes)
        assert honest.store(key, REG.instance_id, payload, shm) is True
        assert honest.retrieve(key, REG.instance_id, shm) == payload


def test_a_connection_under_a_dropped_ones_identity_cannot_lift_its_fence(make_mp_server: Any) -> None:
    server = make_mp_server(l1_write_ttl_s=1.0, l1_lock_ttl_s=1.0)
    url = mp_address(server)
    victim_key = one_chunk(9, "victim")
    prepare_and_drop(url, victim_key)
    transfers: Any = server.frontends[0].handlers  # type: ignore[attr-defined]
    wait_for(
        lambda: bool(transfers.transfers.writes.fenced) and fenced_extents(server) == 1,
        "the dropped client's expired reservation fenced",
    )
    with client_named(url, IDENTITY) as thief:
        # not the connection that registered: answered, and the registration is left alone
        assert thief.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
        assert mp_stats(server).failures["mp_stale_unregister"] == 1
        thief.register(REG)
        # the dropped client's process may still be copying: neither its range's commit nor
        # its instance's unregister from another connection says its copy is over
        assert thief.call("commit_store", victim_key.encode(), REG.instance_id, b"") is False
        assert thief.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
    assert fenced_extents(server) == 1
    assert transfers.transfers.writes.fenced
