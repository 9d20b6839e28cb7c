"""A client stalled before its shared-memory copy never writes into another object.

``prepare_store`` answers the offsets of the reserved extents; LMCache's client gathers
into them, then commits.  Stalled before its copy for longer than the write TTL and the
lease grace, its copy used to land in whatever object the server had put in the reaped
extent since: that object's readers got the stalled client's bytes.  The extent is now
fenced until that client's ``commit_store`` of the range says its copy is over.  L1's
clock is driven through ``expire_locks(now)``, or a short write TTL lets the server's
own sweeps expire the reservation: no timing assertions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from mp_counts import mp_stats
from mpclient import Key, MPClient, Registration, mp_address, one_chunk, wait_for
from writer_processes import transfers_of

from lmcache_tiers.server.app import TiersServer

WRITER = Registration(instance_id=1000)
OTHER = Registration(instance_id=1001)
SIZE = WRITER.object_bytes
#: five chunks: the next store would get the extent an expired reservation left, unfenced
SMALL_L1_GB = 0.0007
#: a write TTL short enough for the server's own sweep and reap to expire a reservation
SHORT_TTL: dict[str, Any] = {"l1_write_ttl_s": 1.0, "l1_lock_ttl_s": 1.0}


def leases(server: TiersServer) -> dict[str, int]:
    return dict(server.storage_status()["l1"]["leases"])


def outlive_write_ttl(server: TiersServer) -> None:
    """What a client stalled before its copy lives through: its reservation is reaped at
    the write TTL, and the grace period of that expired lock ends."""
    l1 = server.storage.l1
    expiry = time.monotonic() + l1.write_ttl_s + 1
    l1.expire_locks(expiry)
    l1.expire_locks(expiry + l1.lease_grace_s + 1)


def prepare(client: MPClient, key: Key, registration: Registration = WRITER) -> list[dict[str, Any]]:
    slots: list[dict[str, Any]] = client.call("prepare_store", key.encode(), registration.instance_id)[
        "context"
    ]["slots"]
    return slots


def fenced_by_the_front_end(server: TiersServer) -> bool:
    """L1 fenced the reservation, and the front end's sweep saw it expire uncommitted."""
    return leases(server)["fenced_extents"] == 1 and bool(transfers_of(server).writes.fenced)


def fence_a_stalled_store(server: TiersServer, writer: MPClient, other: MPClient) -> tuple[str, Key]:
    """Register both clients, and leave the writer's reservation of one chunk uncopied
    until the server's short write TTL has expired and fenced it: the segment's name and
    the stalled chunk."""
    shm: str = writer.register(WRITER)["shm_name"]
    other.register(OTHER)
    stalled = one_chunk(1, "stalled")
    prepare(writer, stalled)
    wait_for(lambda: fenced_by_the_front_end(server), "the expired reservation fenced")
    return shm, stalled


def test_a_late_copy_of_a_stalled_client_never_lands_in_another_object(make_mp_server: Any) -> None:
    server = make_mp_server(l1_size_gb=SMALL_L1_GB)
    with MPClient(mp_address(server)) as writer, MPClient(mp_address(server)) as other:
        shm = writer.register(WRITER)["shm_name"]
        other.register(OTHER)
        stalled = one_chunk(1, "stalled")
        (slot,) = prepare(writer, stalled)
        outlive_write_ttl(server)
        # Another client stores meanwhile: the extent it gets must not be the stalled one's.
        assert other.store(one_chunk(2, "victim"), OTHER.instance_id, [b"\x11" * SIZE], shm)
        # The stalled client wakes up, copies into its slot and commits (too late).
        writer.segment(shm)[slot["offset"] : slot["offset"] + slot["length"]] = b"\xee" * SIZE
        assert writer.call("commit_store", stalled.encode(), WRITER.instance_id, b"") is False

        assert other.retrieve(one_chunk(2, "victim-read"), OTHER.instance_id, shm) == [b"\x11" * SIZE]
        assert mp_stats(server).store_keys_refused["reservation_lost"] == 1
        # Its commit said the copy was over: the fenced extent went back.
        held = leases(server)
        assert held["quarantined_fenced"] == held["reclaimed_writer_done"] == 1
        assert held["fenced_extents"] == held["fenced_bytes"] == 0
        # and the client stores the chunk again as usual
        assert writer.store(stalled, WRITER.instance_id, [b"\xee" * SIZE], shm)
        assert other.retrieve(one_chunk(1, "stalled-read"), OTHER.instance_id, shm) == [b"\xee" * SIZE]


def test_a_client_that_never_commits_keeps_its_extent_out_of_reach(make_mp_server: Any) -> None:
    server = make_mp_server(l1_size_gb=SMALL_L1_GB)
    with MPClient(mp_address(server)) as writer, MPClient(mp_address(server)) as other:
        shm = writer.register(WRITER)["shm_name"]
        other.register(OTHER)
        (slot,) = prepare(writer, one_chunk(1, "stalled"))
        outlive_write_ttl(server)
        server.storage.l1.expire_locks(time.monotonic() + 10 * server.storage.l1.write_ttl_s)
        # Others store, whatever the time: none gets the fenced extent
        for sequence in range(2, 5):
            payload = [bytes([sequence]) * SIZE]
            assert other.store(one_chunk(sequence, f"other-{sequence}"), OTHER.instance_id, payload, shm)
        writer.segment(shm)[slot["offset"] : slot["offset"] + slot["length"]] = b"\xee" * SIZE
        for sequence in range(2, 5):
            got = other.retrieve(one_chunk(sequence, f"read-{sequence}"), OTHER.instance_id, shm)
            assert got == [bytes([sequence]) * SIZE]
        assert leases(server)["fenced_extents"] == 1


def test_stores_are_refused_while_fenced_reservations_reach_their_bound(make_mp_server: Any) -> None:
    server = make_mp_server(**SHORT_TTL)
    transfers = transfers_of(server)
    transfers.fenced_bytes_bound = SIZE  # one fenced chunk reaches it
    with MPClient(mp_address(server)) as writer, MPClient(mp_address(server)) as other:
        shm, stalled = fence_a_stalled_store(server, writer, other)
        # Any client's store is refused: no slots, so it skips its copy and commit.
        assert prepare(other, one_chunk(2, "next"), OTHER) == []
        stats = mp_stats(server)
        assert stats.failures["mp_store_refused_fenced"] == 1
        assert stats.store_keys_refused["mp_store_refused_fenced"] == 1
        # The stalled client's (late) commit lifts the fence, and stores go on.
        assert writer.call("commit_store", stalled.encode(), WRITER.instance_id, b"") is False
        assert leases(server)["fenced_extents"] == 0
        assert transfers.writes.fenced_bytes == 0
        assert other.store(one_chunk(2, "next"), OTHER.instance_id, [bytes(SIZE)], shm)


def test_a_range_whose_expired_reservation_is_outstanding_is_not_reserved_again_for_its_connection(
    make_mp_server: Any,
) -> None:
    server = make_mp_server(**SHORT_TTL)
    with MPClient(mp_address(server)) as writer, MPClient(mp_address(server)) as other:
        shm, stalled = fence_a_stalled_store(server, writer, other)
        # A second reservation of the range would make its commit ambiguous: which copy ended?
        assert prepare(writer, stalled) == []
        assert mp_stats(server).store_keys_refused["mp_store_refused_fenced"] == 1
        # Other connections are not held up by it.
        assert other.store(one_chunk(1, "other"), OTHER.instance_id, [bytes(SIZE)], shm)
        assert leases(server)["fenced_extents"] == 1


def test_the_reservations_of_a_reaped_instance_are_not_handed_to_other_chunks(
    make_mp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A client stalled before its copy is silent: reaped, its instance's reservations
    used to be aborted, their extents free for the next store under its late copy."""
    caplog.set_level(logging.INFO, logger="lmcache_plugin_lmcache_mp")
    server = make_mp_server(l1_size_gb=SMALL_L1_GB, worker_registration_grace_s=0.3)
    frontend: Any = server.frontends[0]
    with MPClient(mp_address(server)) as writer, MPClient(mp_address(server)) as other:
        shm = writer.register(WRITER)["shm_name"]
        other.register(OTHER)
        assert other.call("ping", OTHER.instance_id) is True  # a pinged instance has 120 s
        (slot,) = prepare(writer, one_chunk(1, "stalled"))
        wait_for(lambda: WRITER.instance_id not in frontend.shared.instances, "the silent instance reaped")
        assert other.store(one_chunk(2, "victim"), OTHER.instance_id, [b"\x11" * SIZE], shm)
        writer.segment(shm)[slot["offset"] : slot["offset"] + slot["length"]] = b"\xee" * SIZE
        assert other.retrieve(one_chunk(2, "victim-read"), OTHER.instance_id, shm) == [b"\x11" * SIZE]
        # its log line says what happened to its stores: not aborted, left to their deadline
        assert "unfinished stores left to their write deadline" in caplog.text
        assert "stores aborted" not in caplog.text
        # left to the write TTL, then fenced as any reservation never committed
        outlive_write_ttl(server)
        assert leases(server)["fenced_extents"] == 1


def test_an_unregister_by_its_connection_lifts_the_fence(make_mp_server: Any) -> None:
    """LMCache's client unregisters once it has drained its gathers and commits."""
    server = make_mp_server(l1_size_gb=SMALL_L1_GB)
    with MPClient(mp_address(server)) as writer:
        writer.register(WRITER)
        prepare(writer, one_chunk(1, "stalled"))
        outlive_write_ttl(server)
        assert leases(server)["fenced_extents"] == 1
        assert writer.call("unregister_kv_cache_engine_driven_context", WRITER.instance_id) is None
        held = leases(server)
        assert held["fenced_extents"] == 0
        assert held["reclaimed_writer_done"] == 1


def test_an_unregister_gives_back_the_fences_the_front_end_holds(make_mp_server: Any) -> None:
    server = make_mp_server(**SHORT_TTL)
    with MPClient(mp_address(server)) as writer:
        writer.register(WRITER)
        prepare(writer, one_chunk(1, "stalled"))
        wait_for(lambda: fenced_by_the_front_end(server), "the expired reservation fenced")
        writer.call("unregister_kv_cache_engine_driven_context", WRITER.instance_id)
        assert leases(server)["fenced_extents"] == 0
        writes = transfers_of(server).writes
        assert not writes.fenced and writes.fenced_bytes == 0
