"""An unregister from a connection whose registration is no longer in force gives back
what that connection itself prepared.

Client processes share fixed instance ids (``lmcache bench server``), and a restarted
one registers the id again while the process before it may still unregister on its way
out: that unregister leaves the registration alone (``mp_stale_unregister``).  It used to
leave everything else alone too, the earlier connection's own read locks, reservations
and fences included -- though its client unregisters once its copies have ended -- so
those waited for the lock TTL, the write TTL, and a commit that never comes (for good
when the client's process could not be told).  Now they go, as at any unregister; the
connection whose registration is in force keeps its own.
"""

from __future__ import annotations

from typing import Any

from mp_counts import mp_stats
from mpclient import (
    MPClient,
    Registration,
    chunk_payloads,
    mp_address,
    one_chunk,
    wait_for,
)
from writer_processes import fenced_extents, transfers_of

from lmcache_tiers.server.app import TiersServer

REG = Registration()
UNREGISTER = "unregister_kv_cache_engine_driven_context"


def l1(server: TiersServer) -> dict[str, Any]:
    return dict(server.storage.status()["l1"])


def test_a_stale_unregister_gives_back_its_own_connections_locks_and_reservations(
    mp_server: TiersServer,
) -> None:
    address = mp_address(mp_server)
    with MPClient(address) as earlier, MPClient(address) as restarted:
        earlier.register(REG)
        shm = restarted.register(REG)["shm_name"]  # the same id and layout: now the restarted one's
        payload = chunk_payloads(1, 1, REG.object_bytes)
        assert restarted.store(one_chunk(1, "stored"), REG.instance_id, payload, shm)
        # The earlier process's transfers, left unfinished as it goes.
        assert earlier.call("prepare_retrieve", one_chunk(1, "read").encode(), REG.instance_id)["success"]
        slots = earlier.call("prepare_store", one_chunk(2, "write").encode(), REG.instance_id)["context"]
        assert len(slots["slots"]) == 1
        assert (l1(mp_server)["read_locks"], l1(mp_server)["write_locked"]) == (1, 1)
        assert earlier.call(UNREGISTER, REG.instance_id) is None
        assert mp_stats(mp_server).failures["mp_stale_unregister"] == 1
        assert (l1(mp_server)["read_locks"], l1(mp_server)["write_locked"]) == (0, 0)
        assert mp_stats(mp_server).store_keys_refused["unregistered"] == 1
        # The registration in force, and its connection's transfers, are the restarted one's.
        assert [entry["instance_id"] for entry in mp_server.frontends[0].status()["instances"]] == [
            REG.instance_id
        ]
        restarted_payload = chunk_payloads(2, 1, REG.object_bytes)
        prepared = restarted.call("prepare_store", one_chunk(2, "again").encode(), REG.instance_id)
        [slot] = prepared["context"]["slots"]  # the chunk is no longer held by the earlier one
        restarted.segment(shm)[slot["offset"] : slot["offset"] + slot["length"]] = restarted_payload[0]
        assert restarted.call("prepare_retrieve", one_chunk(1, "r2").encode(), REG.instance_id)["success"]
        assert earlier.call(UNREGISTER, REG.instance_id) is None  # again: nothing of the restarted one's
        assert (l1(mp_server)["read_locks"], l1(mp_server)["write_locked"]) == (1, 1)
        assert restarted.call("commit_store", one_chunk(2, "again").encode(), REG.instance_id, b"") is True
        assert restarted.call("commit_retrieve", one_chunk(1, "r2").encode(), REG.instance_id) is True
        assert restarted.retrieve(one_chunk(2, "r3"), REG.instance_id, shm) == restarted_payload


def test_a_stale_unregister_lifts_its_own_connections_fences(make_mp_server: Any) -> None:
    # A write TTL short enough for the server's own sweeps to expire and fence the
    # reservation.  The client is in the server's process, which no exit lifts the fence of.
    server = make_mp_server(l1_write_ttl_s=1.0, l1_lock_ttl_s=1.0)
    address = mp_address(server)
    transfers = transfers_of(server)
    with MPClient(address) as earlier, MPClient(address) as restarted:
        earlier.register(REG)
        restarted.register(REG)
        assert (
            len(
                earlier.call("prepare_store", one_chunk(3, "w").encode(), REG.instance_id)["context"]["slots"]
            )
            == 1
        )
        wait_for(
            lambda: bool(transfers.writes.fenced) and fenced_extents(server) == 1,
            "the earlier client's expired reservation fenced",
        )
        assert earlier.call(UNREGISTER, REG.instance_id) is None
        assert mp_stats(server).failures["mp_stale_unregister"] == 1
        assert fenced_extents(server) == 0
        assert not transfers.writes.fenced
