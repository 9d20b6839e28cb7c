"""A client whose instance was reaped for its silence, and that then unregisters it, gets
back what its connection prepared under the id.

Reaping releases the instance's read locks but leaves its stores pending (a silent
client may be stalled before its copy): they expire at the write TTL and are fenced.
When that client comes back and unregisters -- LMCache's client does so once its gathers
and commits have ended -- the instance is unknown (``mp_unregister_unknown``), and its
connection's reservations used to stay: write-locked until the write TTL, then fenced
until the client's process exit was seen (for good when it could not be told).  Now they
go as at any unregister.
"""

from __future__ import annotations

from typing import Any

from mp_counts import mp_stats
from mpclient import MPClient, Registration, mp_address, one_chunk, wait_for

from lmcache_tiers.server.app import TiersServer

REG = Registration()
UNREGISTER = "unregister_kv_cache_engine_driven_context"
#: the silence after which an instance that never pinged is reaped
GRACE_S = 1.0


def l1(server: TiersServer) -> dict[str, Any]:
    return dict(server.storage_status()["l1"])


def reaped(server: TiersServer) -> bool:
    return not server.frontends[0].status()["instances"]


def prepare_and_fall_silent(server: TiersServer, client: MPClient, sequence: int) -> None:
    client.register(REG)
    prepared = client.call("prepare_store", one_chunk(sequence, "stalled").encode(), REG.instance_id)
    assert len(prepared["context"]["slots"]) == 1
    wait_for(lambda: reaped(server), "the silent instance was never reaped")


def fenced_server(make_mp_server: Any) -> tuple[TiersServer, Any]:
    """A server whose own sweeps fence a reservation soon after a reaping (the write TTL
    short); its clients run in the server's process, which no exit lifts the fence of."""
    server = make_mp_server(worker_registration_grace_s=GRACE_S, l1_write_ttl_s=1.0, l1_lock_ttl_s=1.0)
    return server, server.frontends[0].handlers.transfers


def prepare_and_get_fenced(server: TiersServer, transfers: Any, client: MPClient, sequence: int) -> None:
    prepare_and_fall_silent(server, client, sequence)
    wait_for(
        lambda: bool(transfers.writes.fenced) and l1(server)["leases"]["fenced_extents"] == 1,
        "the reaped instance's expired reservation fenced",
    )


def test_an_unregister_after_the_reaping_aborts_the_connections_reservations(make_mp_server: Any) -> None:
    server = make_mp_server(worker_registration_grace_s=GRACE_S)
    with MPClient(mp_address(server)) as client:
        prepare_and_fall_silent(server, client, 1)
        assert l1(server)["write_locked"] == 1  # left to the write TTL by the reaping
        assert client.call(UNREGISTER, REG.instance_id) is None
        assert mp_stats(server).failures["mp_unregister_unknown"] == 1
        assert l1(server)["write_locked"] == 0
        assert mp_stats(server).store_keys_refused["unregistered"] == 1
        # Registered again, the chunk is free for a store at once.
        client.register(REG)
        prepared = client.call("prepare_store", one_chunk(1, "again").encode(), REG.instance_id)
        assert len(prepared["context"]["slots"]) == 1


def test_an_unregister_after_the_reaping_lifts_the_connections_fences(make_mp_server: Any) -> None:
    server, transfers = fenced_server(make_mp_server)
    with MPClient(mp_address(server)) as client:
        prepare_and_get_fenced(server, transfers, client, 2)
        assert client.call(UNREGISTER, REG.instance_id) is None
        assert l1(server)["leases"]["fenced_extents"] == 0
        assert not transfers.writes.fenced


def test_a_late_commit_after_the_reaping_is_refused_and_gives_the_reservation_back(
    make_mp_server: Any,
) -> None:
    """Refused as by LMCache's server (the instance is not registered), the commit still
    says the copy has ended: the reservation goes, never made visible."""
    server = make_mp_server(worker_registration_grace_s=GRACE_S)
    with MPClient(mp_address(server)) as client:
        prepare_and_fall_silent(server, client, 3)
        assert client.unanswered("commit_store", one_chunk(3, "stalled").encode(), REG.instance_id, b"")
        assert client.call("noop") == "OK"  # handled in order: the commit was handled before
        assert mp_stats(server).failures["mp_unregistered_instance"] == 1
        assert l1(server)["write_locked"] == 0
        assert l1(server)["objects"] == 0
        assert mp_stats(server).store_keys_refused["unregistered"] == 1


def test_a_late_commit_after_the_reaping_lifts_the_fence(make_mp_server: Any) -> None:
    server, transfers = fenced_server(make_mp_server)
    with MPClient(mp_address(server)) as client:
        prepare_and_get_fenced(server, transfers, client, 4)
        assert client.unanswered("commit_store", one_chunk(4, "stalled").encode(), REG.instance_id, b"")
        assert client.call("noop") == "OK"  # handled in order: the commit was handled before
        assert l1(server)["leases"]["fenced_extents"] == 0
        assert not transfers.writes.fenced
