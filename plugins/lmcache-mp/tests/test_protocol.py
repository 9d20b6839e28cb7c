"""The operations of LMCache's MP protocol against a live front end (real StorageManager)."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import pytest
from lmcache_plugin_lmcache_mp.state import MAX_MAPPING_CONNECTIONS
from mp_counts import mp_stats
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

REG = Registration()
CHUNK = REG.object_bytes


def l1(server: TiersServer) -> dict[str, Any]:
    status: dict[str, Any] = server.storage.status()["l1"]
    return status


def stored(client: MPClient, sequence: int, shm: str, chunks: int = 4) -> list[bytes]:
    payloads = chunk_payloads(sequence, chunks, CHUNK)
    key = Key(tokens_of(sequence, chunks * 256), f"store-{sequence}", worker_id=0)
    assert client.store(key, REG.instance_id, payloads, shm) is True
    return payloads


def test_trivia_answer_as_lmcache(client: MPClient) -> None:
    assert client.call("get_chunk_size") == 256
    assert client.call("noop") == "OK"
    assert client.call("ping", None) is True
    assert client.call("get_experimental") == []
    assert client.call("report_block_allocation", 1, "m", []) is None
    assert client.call("unregister_kv_cache", 7) is None
    # operations are also accepted by name
    assert client.call(OPERATION := "get_chunk_size".upper().lower()) == 256, OPERATION


def test_registration_advertises_the_l1_segment(client: MPClient, mp_server: TiersServer) -> None:
    reply = client.register(REG)
    arena = mp_server.storage.l1.arena
    assert reply == {"shm_name": arena.name, "pool_size": arena.size}
    assert client.register(REG) == reply  # a repeat only refreshes liveness
    status = mp_server.frontends[0].status()
    assert status["instances"][0]["layout"] == "bfloat16[2,2,256,64]"


def test_store_lookup_retrieve_round_trip(client: MPClient, mp_server: TiersServer) -> None:
    shm = client.register(REG)["shm_name"]
    assert client.lookup(Key(tokens_of(1), "cold")) == 0
    payloads = stored(client, 1, shm)
    lookup = Key(tokens_of(1), "warm")
    assert client.lookup(lookup) == 4
    assert client.call("query_prefetch_status", "warm") == 0  # delivered once
    assert l1(mp_server)["read_locks"] == 4  # the lookup's locks
    assert client.retrieve(Key(tokens_of(1), "warm", worker_id=0), REG.instance_id, shm) == payloads
    assert l1(mp_server)["read_locks"] == 0  # the retrieve consumed them
    assert client.call("end_session", "warm") is None
    layout = next(iter(mp_server.storage.l1._table.objects.values())).layout
    assert layout == "bfloat16[2,2,256,64]"
    stats = mp_stats(mp_server)
    assert (stats.store_chunks, stats.retrieve_chunks, stats.store_bytes) == (4, 4, 4 * CHUNK)


def test_a_store_of_chunks_present_reserves_only_the_new_ones(client: MPClient) -> None:
    shm = client.register(REG)["shm_name"]
    tokens = tokens_of(2)
    first_half = Key(tokens, "r", start=0, end=512, worker_id=0)
    assert client.store(first_half, REG.instance_id, chunk_payloads(2, 2, CHUNK), shm)
    whole = Key(tokens, "r", worker_id=0)
    prepared = client.call("prepare_store", whole.encode(), REG.instance_id)["context"]
    assert prepared["chunk_indices"] == [2, 3]
    assert [slot["shape"] for slot in prepared["slots"]] == [[2, 2, 256, 64]] * 2
    assert {slot["dtype"] for slot in prepared["slots"]} == {"bfloat16"}
    assert client.call("commit_store", whole.encode(), REG.instance_id, b"") is True
    again = client.call("prepare_store", whole.encode(), REG.instance_id)
    assert again == {"context": {"slots": [], "chunk_indices": []}}


def test_a_repeated_prepare_store_replaces_the_first(client: MPClient, mp_server: TiersServer) -> None:
    shm = client.register(REG)["shm_name"]
    key = Key(tokens_of(30), "r", worker_id=0)
    first = client.call("prepare_store", key.encode(), REG.instance_id)["context"]
    again = client.call("prepare_store", key.encode(), REG.instance_id)["context"]  # a client retry
    assert len(first["slots"]) == len(again["slots"]) == 4
    assert l1(mp_server)["write_locked"] == 4
    segment = client.segment(shm)
    payloads = chunk_payloads(30, 4, CHUNK)
    for slot, payload in zip(again["slots"], payloads, strict=True):
        segment[slot["offset"] : slot["offset"] + slot["length"]] = payload
    assert client.call("commit_store", key.encode(), REG.instance_id, b"") is True
    assert client.retrieve(key, REG.instance_id, shm) == payloads


def test_another_connection_preparing_the_same_store_never_takes_the_writers_slots(
    client: MPClient, mp_server: TiersServer
) -> None:
    """Two client processes with the same instance and request ids (``lmcache bench
    server`` runs with fixed ones): the second one's prepare is no retry of the first's, so
    it must neither abort the first's reservation (whose slots are being written) nor have
    its own reservation committed by the first one's commit."""
    shm = client.register(REG)["shm_name"]
    key = Key(tokens_of(32), "same-request", worker_id=0)
    first = client.call("prepare_store", key.encode(), REG.instance_id)["context"]
    assert first["chunk_indices"] == [0, 1, 2, 3]
    with MPClient(mp_address(mp_server)) as second:
        again = second.call("prepare_store", key.encode(), REG.instance_id)
        assert again == {"context": {"slots": [], "chunk_indices": []}}  # being written
        segment = client.segment(shm)
        payloads = chunk_payloads(32, 4, CHUNK)
        for slot, payload in zip(first["slots"], payloads, strict=True):
            segment[slot["offset"] : slot["offset"] + slot["length"]] = payload
        assert client.call("commit_store", key.encode(), REG.instance_id, b"") is True
        assert second.call("commit_store", key.encode(), REG.instance_id, b"") is False
    assert client.retrieve(Key(tokens_of(32), "reader", worker_id=0), REG.instance_id, shm) == payloads
    assert mp_stats(mp_server).failures["mp_commit_without_reservation"] == 1


def test_a_second_request_never_takes_a_reservation_being_written(
    client: MPClient, mp_server: TiersServer
) -> None:
    shm = client.register(REG)["shm_name"]
    tokens = tokens_of(31)
    writer = Key(tokens, "writer", worker_id=0)
    other = Key(tokens, "other", worker_id=0)
    first = client.call("prepare_store", writer.encode(), REG.instance_id)["context"]
    assert first["chunk_indices"] == [0, 1, 2, 3]
    # the chunks are being written: nothing to offer, as from LMCache's server
    again = client.call("prepare_store", other.encode(), REG.instance_id)
    assert again == {"context": {"slots": [], "chunk_indices": []}}
    assert l1(mp_server)["write_locked"] == 4
    assert client.call("commit_store", other.encode(), REG.instance_id, b"") is False  # not its own
    assert client.lookup(Key(tokens, "early")) == 0  # nothing visible before its writer commits
    client.call("end_session", "early")
    segment = client.segment(shm)
    payloads = chunk_payloads(31, 4, CHUNK)
    for slot, payload in zip(first["slots"], payloads, strict=True):
        segment[slot["offset"] : slot["offset"] + slot["length"]] = payload
    assert client.call("commit_store", writer.encode(), REG.instance_id, b"") is True
    assert client.lookup(Key(tokens, "late")) == 4
    assert client.retrieve(Key(tokens, "late", worker_id=0), REG.instance_id, shm) == payloads
    stats = mp_stats(mp_server)
    assert (stats.store_chunks, stats.failures["mp_commit_without_reservation"]) == (4, 1)


def test_commit_without_prepare_is_false(client: MPClient, mp_server: TiersServer) -> None:
    client.register(REG)
    key = Key(tokens_of(3), "r", worker_id=0)
    assert client.call("commit_store", key.encode(), REG.instance_id, b"") is False
    assert mp_stats(mp_server).failures["mp_commit_without_reservation"] == 1


def test_retrieve_of_a_missing_chunk_is_a_miss_holding_nothing(
    client: MPClient, mp_server: TiersServer
) -> None:
    shm = client.register(REG)["shm_name"]
    stored(client, 4, shm, chunks=2)
    key = Key(tokens_of(4), "r", worker_id=0)  # four chunks asked, two there
    reply = client.call("prepare_retrieve", key.encode(), REG.instance_id)
    assert reply == {"success": False, "data": b"", "context": {}}
    assert client.call("commit_retrieve", key.encode(), REG.instance_id) is True
    assert l1(mp_server)["read_locks"] == 0


def test_free_lookup_locks_and_end_session_give_locks_back(client: MPClient, mp_server: TiersServer) -> None:
    shm = client.register(REG)["shm_name"]
    stored(client, 5, shm)
    lookup = Key(tokens_of(5), "req")
    assert client.lookup(lookup) == 4
    freed = Key(tokens_of(5), "req", start=0, end=512)
    assert client.call("free_lookup_locks", freed.encode(), 1) is None
    assert l1(mp_server)["read_locks"] == 2
    assert client.call("end_session", "req") is None
    assert l1(mp_server)["read_locks"] == 0
    assert client.call("query_prefetch_status", "req") == 0  # unknown now


def test_a_second_lookup_of_a_request_replaces_the_first(client: MPClient, mp_server: TiersServer) -> None:
    shm = client.register(REG)["shm_name"]
    stored(client, 6, shm)
    assert client.lookup(Key(tokens_of(6), "same")) == 4
    assert client.lookup(Key(tokens_of(6), "same")) == 4
    assert l1(mp_server)["read_locks"] == 4  # the first lookup's locks were given back
    client.call("end_session", "same")
    assert l1(mp_server)["read_locks"] == 0


def test_a_retrieve_commits_against_the_lookup_it_was_prepared_under(
    client: MPClient, mp_server: TiersServer
) -> None:
    # A request looked up again (vLLM reschedules a preempted request under its id) while
    # a retrieve of its first lookup is open: that retrieve's commit must not take the new
    # lookup's locks, which keep its chunks in L1 until its own retrieve.
    shm = client.register(REG)["shm_name"]
    stored(client, 16, shm)
    assert client.lookup(Key(tokens_of(16), "again")) == 4
    key = Key(tokens_of(16), "again", worker_id=0)
    reply = client.call("prepare_retrieve", key.encode(), REG.instance_id)
    assert reply["success"] is True
    assert client.lookup(Key(tokens_of(16), "again")) == 4
    assert l1(mp_server)["read_locks"] == 8  # the open retrieve's and the new lookup's
    assert client.call("commit_retrieve", key.encode(), REG.instance_id) is True
    assert l1(mp_server)["read_locks"] == 4  # the new lookup's, for its own retrieve
    assert client.retrieve(key, REG.instance_id, shm) == chunk_payloads(16, 4, CHUNK)
    assert l1(mp_server)["read_locks"] == 0  # which consumed them


def test_a_chunk_counts_only_when_every_rank_has_it(make_mp_server: Any) -> None:
    server = make_mp_server()
    ranks = [Registration(instance_id=2000 + worker, world_size=2) for worker in range(2)]
    with MPClient(mp_address(server)) as client:
        shm = client.register(ranks[0])["shm_name"]
        client.register(ranks[1])
        tokens = tokens_of(7)
        payloads = chunk_payloads(7, 4, CHUNK)
        key0 = Key(tokens, "s", worker_id=0, world_size=2)
        assert client.store(key0, ranks[0].instance_id, payloads, shm)
        key1 = Key(tokens, "s", start=0, end=512, worker_id=1, world_size=2)
        assert client.store(key1, ranks[1].instance_id, payloads[:2], shm)
        assert client.lookup(Key(tokens, "l", world_size=2)) == 2
        assert l1(server)["read_locks"] == 4  # two chunks x two ranks; rank 0 of chunk 2 released
        client.call("end_session", "l")
        assert l1(server)["read_locks"] == 0


def test_refusals_get_no_reply_and_are_counted(client: MPClient, mp_server: TiersServer) -> None:
    client.register(REG)
    key = Key(tokens_of(8), "r", worker_id=0)
    assert client.unanswered("prepare_store", key.encode(), 4242)  # unregistered instance
    assert client.unanswered("lookup", Key(tokens_of(8), "r", num_kv_readers=0).encode(), 1)
    assert client.unanswered("register_kv_cache", 1, [], "m", 1, "vllm", {}, [])
    assert client.unanswered(99)  # unknown operation id
    assert client.unanswered("no_such_operation")
    assert client.unanswered("get_chunk_size", 1)  # payload count mismatch
    assert client.unanswered("lookup", {"model_name": "m"}, 1)  # a key missing fields
    bad_dtype = Registration(instance_id=5, dtype_str="float42").encode()
    assert client.unanswered("register_kv_cache_engine_driven_context", bad_dtype)
    assert client.call("ping", None) is True
    failures = mp_stats(mp_server).failures
    assert failures["mp_unregistered_instance"] == 1
    assert failures["mp_not_served"] == 1
    assert failures["mp_unknown_op"] == 2
    assert failures["mp_bad_request"] == 4


def test_a_request_not_served_is_logged_with_its_request_id(
    client: MPClient, mp_server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache-driven ``store`` carries a key: the operator tracing a request by its id in
    the logs finds its refusal too."""
    key = Key(tokens_of(8), "driven-store-7", worker_id=0)
    with caplog.at_level(logging.WARNING):
        assert client.unanswered("store", key.encode(), REG.instance_id, [[1]], b"stub_ipc_handle")
    assert mp_stats(mp_server).failures["mp_not_served"] == 1
    refusals = [r.getMessage() for r in caplog.records if "mp_not_served" in r.getMessage()]
    assert len(refusals) == 1 and "request_id driven-store-7" in refusals[0], refusals


def test_a_store_l1_cannot_hold_gets_no_slots(make_mp_server: Any) -> None:
    server = make_mp_server(l1_size_gb=0.0007)  # room for five chunks
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        stored(client, 9, shm)
        assert client.lookup(Key(tokens_of(9), "holding")) == 4  # locked: eviction cannot take them
        key = Key(tokens_of(90), "r", worker_id=0)
        # as from LMCache's server: no slots, so the client neither gathers nor commits
        refused = client.call("prepare_store", key.encode(), REG.instance_id)
        assert refused == {"context": {"slots": [], "chunk_indices": []}}
        assert l1(server)["write_locked"] == 0
        assert mp_stats(server).failures["mp_store_refused_l1_full"] == 1
        assert client.lookup(Key(tokens_of(9), "again")) == 4  # nothing was evicted for it


def test_unregister_aborts_unfinished_stores(client: MPClient, mp_server: TiersServer) -> None:
    client.register(REG)
    key = Key(tokens_of(10), "r", worker_id=0)
    assert len(client.call("prepare_store", key.encode(), REG.instance_id)["context"]["slots"]) == 4
    assert l1(mp_server)["write_locked"] == 4
    assert client.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
    assert l1(mp_server)["write_locked"] == 0 and l1(mp_server)["objects"] == 0
    assert client.unanswered("commit_store", key.encode(), REG.instance_id, b"")  # no registration


def test_an_unregister_leaves_the_transfers_other_connections_are_copying(
    client: MPClient, mp_server: TiersServer
) -> None:
    """Another process with the same instance id may be copying into its reserved slots or
    out of its read-locked ones: freed now, those extents could change hands under its copy.
    Its transfers are left to their TTLs (counted when they expire)."""
    shm = client.register(REG)["shm_name"]
    stored(client, 33, shm)
    with MPClient(mp_address(mp_server)) as other:
        other.register(REG)  # it maps the segment too; then the registration is the first's again
        client.register(REG)
        reading = Key(tokens_of(33), "other-read", worker_id=0)
        assert other.call("prepare_retrieve", reading.encode(), REG.instance_id)["success"] is True
        writing = Key(tokens_of(34), "other-write", worker_id=0)
        assert len(other.call("prepare_store", writing.encode(), REG.instance_id)["context"]["slots"]) == 4
        own = Key(tokens_of(35), "own-write", worker_id=0)
        assert len(client.call("prepare_store", own.encode(), REG.instance_id)["context"]["slots"]) == 4
        assert client.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
        status = l1(mp_server)
        assert status["write_locked"] == 4  # the other connection's; its own are aborted
        assert status["read_locks"] == 4


def test_a_connection_that_did_not_register_gets_no_slots(client: MPClient, mp_server: TiersServer) -> None:
    """A client of a previous server process that ZeroMQ reconnected here maps that
    server's segment: offsets in this one would have it copy its chunks into memory this
    server never sees (and commit the extents' stale bytes) or read garbage as KV."""
    shm = client.register(REG)["shm_name"]
    stored(client, 39, shm)
    with MPClient(mp_address(mp_server)) as unmapped:
        writing = Key(tokens_of(40), "unmapped-write", worker_id=0)
        assert unmapped.call("prepare_store", writing.encode(), REG.instance_id)["context"]["slots"] == []
        reading = Key(tokens_of(39), "unmapped-read", worker_id=0)
        assert unmapped.call("prepare_retrieve", reading.encode(), REG.instance_id)["success"] is False
        assert mp_stats(mp_server).failures["mp_transfer_unregistered_connection"] == 2
        assert l1(mp_server)["write_locked"] == l1(mp_server)["read_locks"] == 0
        unmapped.register(REG)  # registered: it maps this segment now
        assert len(unmapped.call("prepare_store", writing.encode(), REG.instance_id)["context"]["slots"]) == 4


def test_the_registering_connections_forgotten_first_are_the_least_recently_used(
    client: MPClient, mp_server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache's ``lmcache bench server`` registers fixed instance ids: runs killed before
    they unregister leave connections that registered the id.  A long-running client
    that keeps transferring stays remembered (and served) however many of those come
    after it; the idle ones are forgotten, counted, and their refusal says why."""
    shm = client.register(REG)["shm_name"]
    stored(client, 41, shm)
    reading = Key(tokens_of(41), "busy-read", worker_id=0)
    with MPClient(mp_address(mp_server)) as idle:
        idle.register(REG)  # then it falls silent: the least recently used
        for _ in range(MAX_MAPPING_CONNECTIONS - 1):
            with MPClient(mp_address(mp_server)) as killed:
                killed.register(REG)
            assert client.call("prepare_retrieve", reading.encode(), REG.instance_id)["success"] is True
            assert client.call("commit_retrieve", reading.encode(), REG.instance_id) is True
        writing = Key(tokens_of(42), "busy-write", worker_id=0)
        assert len(client.call("prepare_store", writing.encode(), REG.instance_id)["context"]["slots"]) == 4
        assert mp_stats(mp_server).failures["mp_registrations_forgotten"] == 1
        with caplog.at_level(logging.WARNING):
            idle_write = Key(tokens_of(43), "idle-write", worker_id=0)
            assert idle.call("prepare_store", idle_write.encode(), REG.instance_id)["context"]["slots"] == []
            assert idle.call("ping", REG.instance_id) is False  # asks it to register again
        assert mp_stats(mp_server).failures["mp_transfer_unregistered_connection"] == 1
        lines = [record.getMessage() for record in caplog.records]
        refusals = [line for line in lines if "transfers refused" in line]
        assert len(refusals) == 1 and "registration was forgotten" in refusals[0]
        asks = [line for line in lines if "answered false once" in line]
        assert len(asks) == 1 and "registration was forgotten" in asks[0]
        idle.register(REG)  # remembered again, at the cost of the least recently used
        assert len(idle.call("prepare_store", idle_write.encode(), REG.instance_id)["context"]["slots"]) == 4
        assert mp_stats(mp_server).failures["mp_registrations_forgotten"] == 2


def test_a_registration_with_another_layout_leaves_other_connections_transfers(
    client: MPClient, mp_server: TiersServer
) -> None:
    """A restarted client registering a fixed instance id with another layout replaces the
    registration, but another process sending that id may still be copying into the slots
    it reserved or out of those it read-locked: those stay until their commits (made with
    the layout they were reserved with) or TTLs.  The registering connection's own go."""
    shm = client.register(REG)["shm_name"]
    payloads = stored(client, 36, shm)
    reading = Key(tokens_of(36), "other-read", worker_id=0)
    read_slots = client.call("prepare_retrieve", reading.encode(), REG.instance_id)["context"]["slots"]
    writing = Key(tokens_of(37), "other-write", worker_id=0)
    write_slots = client.call("prepare_store", writing.encode(), REG.instance_id)["context"]["slots"]
    assert len(write_slots) == 4
    with MPClient(mp_address(mp_server)) as restarted:
        restarted.register(REG)  # a restarted client registers before it transfers
        own = Key(tokens_of(38), "own-write", worker_id=0)
        assert len(restarted.call("prepare_store", own.encode(), REG.instance_id)["context"]["slots"]) == 4
        restarted.register(Registration(hidden_dim_size=32))
        status = l1(mp_server)
        assert status["write_locked"] == 4  # the other connection's; its own are aborted
        assert status["read_locks"] == 4
        segment = client.segment(shm)
        assert [bytes(segment[s["offset"] : s["offset"] + s["length"]]) for s in read_slots] == payloads
        assert client.call("commit_retrieve", reading.encode(), REG.instance_id) is True
        written = chunk_payloads(37, 4, CHUNK)
        for slot, payload in zip(write_slots, written, strict=True):
            segment[slot["offset"] : slot["offset"] + slot["length"]] = payload
        before = mp_stats(mp_server).store_bytes
        assert client.call("commit_store", writing.encode(), REG.instance_id, b"") is True
        assert mp_stats(mp_server).store_bytes - before == 4 * CHUNK  # of the layout it reserved
    assert l1(mp_server)["write_locked"] == l1(mp_server)["read_locks"] == 0
    # the chunks keep the layout their bytes were written with: a reader of that layout gets them
    old_layout = Registration(instance_id=REG.instance_id + 1)
    client.register(old_layout)
    assert client.retrieve(Key(tokens_of(37), "reader", worker_id=0), old_layout.instance_id, shm) == written


def test_silent_instances_are_reaped(make_mp_server: Any) -> None:
    server = make_mp_server(worker_registration_grace_s=0.3)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        key = Key(tokens_of(11), "r", worker_id=0)
        client.call("prepare_store", key.encode(), REG.instance_id)
        deadline = time.monotonic() + 10
        while server.frontends[0].status()["instances"]:
            assert time.monotonic() < deadline, "the instance was never reaped"
            time.sleep(0.1)
        # A silent client may be stalled before its copy: its reservation is left to the TTL.
        assert l1(server)["write_locked"] == 4
        assert mp_stats(server).failures["mp_instance_reaped"] == 1


def test_lookup_of_an_unregistered_model_is_zero(client: MPClient) -> None:
    assert client.lookup(Key(tokens_of(12), "x", model_name="other")) == 0
    # LMCache records the 0-hit lookup before it looks at num_kv_readers
    assert client.lookup(Key(tokens_of(12), "y", model_name="other", num_kv_readers=0)) == 0


def test_free_lookup_locks_with_nothing_to_free_is_void_whatever_its_readers(
    client: MPClient, mp_server: TiersServer
) -> None:
    shm = client.register(REG)["shm_name"]
    stored(client, 16, shm)
    tokens = tokens_of(16)

    def unread(**fields: Any) -> dict[str, Any]:
        return Key(tokens, "q", num_kv_readers=0, **fields).encode()

    # an empty range (LMCache checks it first), then a request without a lookup
    assert client.call("free_lookup_locks", unread(start=512, end=512), 1) is None
    assert client.call("free_lookup_locks", unread(), 1) is None
    assert client.lookup(Key(tokens, "q")) == 4
    assert client.call("free_lookup_locks", unread(start=768, end=768), 1) is None
    assert client.unanswered("free_lookup_locks", unread(), 1)  # locks to free: refused
    assert l1(mp_server)["read_locks"] == 4
    assert mp_stats(mp_server).failures["mp_bad_request"] == 1
    client.call("end_session", "q")
    assert l1(mp_server)["read_locks"] == 0


def test_transfers_keep_an_instance_that_never_pings_alive(make_mp_server: Any) -> None:
    grace_s = 1.0
    server = make_mp_server(worker_registration_grace_s=grace_s)
    instances = server.frontends[0].shared.instances
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        registered_at = instances[REG.instance_id].last_seen
        stored(client, 17, shm)
        assert instances[REG.instance_id].last_seen > registered_at  # LMCache refreshes it so too
        # stores for several times the grace, never a ping: the instance stays
        until = time.monotonic() + 3 * grace_s
        while time.monotonic() < until:
            assert client.retrieve(Key(tokens_of(17), "r", worker_id=0), REG.instance_id, shm) is not None
            assert client.store(Key(tokens_of(17), "r", worker_id=0), REG.instance_id, [], shm) is True
            time.sleep(0.05)
        assert [entry["pinged"] for entry in server.frontends[0].status()["instances"]] == [False]
        assert mp_stats(server).failures["mp_instance_reaped"] == 0


def test_dot_salts_are_answered_and_kept_apart(client: MPClient, mp_server: TiersServer) -> None:
    """LMCache accepts any salt without '@', '/', '\\' or NUL, "." and ".." too."""
    shm = client.register(REG)["shm_name"]
    tokens = tokens_of(18)
    payloads = {salt: chunk_payloads(180 + len(salt), 4, CHUNK) for salt in (".", "..")}
    for salt, chunks in payloads.items():
        assert client.lookup(Key(tokens, f"cold{salt}", cache_salt=salt)) == 0
        assert client.store(
            Key(tokens, f"s{salt}", worker_id=0, cache_salt=salt), REG.instance_id, chunks, shm
        )
    assert client.lookup(Key(tokens, "unsalted")) == 0
    for salt, chunks in payloads.items():
        assert client.lookup(Key(tokens, f"warm{salt}", cache_salt=salt)) == 4
        key = Key(tokens, f"warm{salt}", worker_id=0, cache_salt=salt)
        assert client.retrieve(key, REG.instance_id, shm) == chunks
    assert mp_stats(mp_server).failures["mp_bad_request"] == 0


def test_clear_empties_l1(client: MPClient, mp_server: TiersServer) -> None:
    shm = client.register(REG)["shm_name"]
    stored(client, 13, shm)
    assert client.call("clear", False) is None
    assert l1(mp_server)["objects"] == 0


def test_shutdown_gives_back_what_clients_hold(make_mp_server: Any) -> None:
    server = make_mp_server()
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        stored(client, 14, shm)
        assert client.lookup(Key(tokens_of(14), "held")) == 4
        client.call("prepare_store", Key(tokens_of(15), "w", worker_id=0).encode(), REG.instance_id)
        assert (l1(server)["read_locks"], l1(server)["write_locked"]) == (4, 4)
        server.request_stop()
        frontend = server.frontends[0]
        assert frontend.join(30)
        stats = frontend.stats()
        assert (stats.released_at_stop_locks, stats.released_at_stop_reservations) == (4, 4)
        assert (l1(server)["read_locks"], l1(server)["write_locked"]) == (0, 0)


def test_requests_are_counted_by_operation(client: MPClient, mp_server: TiersServer) -> None:
    client.call("noop")
    client.call("noop")
    client.call("get_chunk_size")
    assert dict(mp_stats(mp_server).requests) == {"noop": 2, "get_chunk_size": 1}
    assert msgspec.json.encode(mp_server.status())  # JSON-able, with both front ends
    assert [entry["type"] for entry in mp_server.status()["frontends"]] == ["lmcache_mp", "native"]


def test_a_retrieve_never_committed_gives_its_lock_back_while_others_read(make_mp_server: Any) -> None:
    """Readers of a hot chunk keep extending its one lock deadline in L1, so L1 never reaps
    the lock of a retrieve whose client died before commit_retrieve: the front end must
    give it back itself, before its deadline (after it, it can no longer tell whose it is)."""
    server = make_mp_server(l1_lock_ttl_s=2.0)
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        payloads = stored(client, 16, shm, chunks=1)
        abandoned = Key(tokens_of(16, 256), "dead", worker_id=0)
        assert client.call("prepare_retrieve", abandoned.encode(), REG.instance_id)["success"]
        started = time.monotonic()
        while time.monotonic() - started < 3.5:  # past the abandoned retrieve's deadline
            reader = Key(tokens_of(16, 256), "hot", worker_id=0)
            assert client.retrieve(reader, REG.instance_id, shm) == payloads
            time.sleep(0.2)
        assert l1(server)["read_locks"] == 0, "the abandoned retrieve's lock is still held"
        assert mp_stats(server).failures["mp_transfer_expired"] == 1


def test_a_transfer_whose_start_is_not_on_a_chunk_boundary_is_refused(
    client: MPClient, mp_server: TiersServer
) -> None:
    """LMCache's client maps slot i to the chunk at ``start + i * chunk_size`` of its block
    ids; a range starting mid-chunk has no such chunks, and rounding it to the next boundary
    would store (or hand out) the bytes of one range under the key of another."""
    shm = client.register(REG)["shm_name"]
    tokens = tokens_of(19)
    ragged = Key(tokens, "r", start=100, end=768, worker_id=0)
    assert client.unanswered("prepare_store", ragged.encode(), REG.instance_id)
    assert l1(mp_server)["write_locked"] == 0
    stored(client, 19, shm)
    assert client.unanswered("prepare_retrieve", ragged.encode(), REG.instance_id)
    assert l1(mp_server)["read_locks"] == 0
    assert mp_stats(mp_server).failures["mp_bad_request"] == 2
    tail = Key(tokens, "r", start=256, end=768, worker_id=0)
    assert client.retrieve(tail, REG.instance_id, shm) == chunk_payloads(19, 4, CHUNK)[1:3]


def test_a_transfer_whose_end_is_no_chunk_boundary_within_its_tokens_is_refused(
    client: MPClient, mp_server: TiersServer
) -> None:
    """LMCache's client scatters the slots it gets into the blocks of ``[start, end)`` and
    reports the whole range loaded (it checks only that the blocks cover the slots): a
    range ending mid-chunk or past the tokens, answered with its full chunks only, would
    leave the engine computing on the rest of its blocks as if they held that KV.
    LMCache's server refuses such a key (an assertion, or "end exceeds the tokens")."""
    shm = client.register(REG)["shm_name"]
    stored(client, 21, shm, chunks=2)  # 513 tokens: two full chunks
    tokens = tokens_of(21, 512)
    for end in (700, 768, 1024):  # mid-chunk; a chunk boundary past the tokens
        for op in ("prepare_retrieve", "prepare_store"):
            assert client.unanswered(op, Key(tokens, "r", end=end, worker_id=0).encode(), REG.instance_id), (
                op,
                end,
            )
    assert (l1(mp_server)["read_locks"], l1(mp_server)["write_locked"]) == (0, 0)
    assert mp_stats(mp_server).failures["mp_bad_request"] == 6
    # LMCache's client commits a retrieve whose prepare got no answer; LMCache's server
    # answers such commits (nothing is pending), so the client does not wait twice
    for key in (Key(tokens, "r", end=700, worker_id=0), Key(tokens, "r", start=100, end=512, worker_id=0)):
        assert client.call("commit_retrieve", key.encode(), REG.instance_id) is True
        assert client.call("commit_store", key.encode(), REG.instance_id, b"") is False
    assert mp_stats(mp_server).failures["mp_commit_without_reservation"] == 2
    assert client.retrieve(Key(tokens, "r", end=512, worker_id=0), REG.instance_id, shm) == chunk_payloads(
        21, 2, CHUNK
    )


def test_a_re_registration_with_another_layout_replaces_the_first(
    client: MPClient, mp_server: TiersServer
) -> None:
    """``lmcache bench server`` registers fixed instance ids: a rerun with another model or
    KV shape registers the same id while the first run's registration is still there."""
    client.register(REG)
    held = Key(tokens_of(20), "old", worker_id=0)
    assert len(client.call("prepare_store", held.encode(), REG.instance_id)["context"]["slots"]) == 4
    rerun = Registration(model_name="other-model", hidden_dim_size=32)
    shm = client.register(rerun)["shm_name"]
    assert l1(mp_server)["write_locked"] == 0  # the first run's unfinished store was aborted
    key = Key(tokens_of(20), "new", worker_id=0, model_name=rerun.model_name)
    prepared = client.call("prepare_store", key.encode(), rerun.instance_id)["context"]
    assert [slot["shape"] for slot in prepared["slots"]] == [[2, 2, 256, 32]] * 4
    assert {slot["length"] for slot in prepared["slots"]} == {rerun.object_bytes}
    segment = client.segment(shm)
    payloads = chunk_payloads(20, 4, rerun.object_bytes)
    for slot, index in zip(prepared["slots"], prepared["chunk_indices"], strict=True):
        segment[slot["offset"] : slot["offset"] + slot["length"]] = payloads[index]
    assert client.call("commit_store", key.encode(), rerun.instance_id, b"") is True
    assert client.lookup(Key(tokens_of(20), "look", model_name=rerun.model_name)) == 4
    assert client.call("end_session", "look") is None
    assert client.register(rerun) == {"shm_name": shm, "pool_size": mp_server.storage.l1.arena.size}
    assert mp_server.frontends[0].status()["instances"][0]["layout"] == "bfloat16[2,2,256,32]"


def test_releases_never_drop_a_lock_another_holder_forgot(make_mp_server: Any) -> None:
    """L1 reaps each lock at its own deadline, but a release does not say which lock it
    drops: told nothing, it drops the one expiring first, maybe a lock another holder
    forgot, and the released lock then lives on.  A lookup's and a retrieve's releases
    say when their locks were taken, so only live holders' locks are left."""
    step = 3 * 2.0 / 64  # lock deadlines fall on a grid of a 64th of the lock TTL
    server = make_mp_server(l1_lock_ttl_s=2.0)
    storage = server.storage
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        payloads = stored(client, 17, shm, chunks=2)
        assert storage.flush(10)
        keys = list(storage.l1._table.objects)
        forgotten = storage.read(keys)  # its holder forgets these locks (never releases them)
        forgotten_deadline = forgotten[0].lock_deadline
        time.sleep(step)
        reader = Key(tokens_of(17, 512), "reader", worker_id=0)
        assert client.lookup(reader) == 2
        time.sleep(step)
        assert len(storage.read(keys)) == 2  # a hot prefix: another reader's locks, still held
        # The retrieve's own locks, and one lookup lock per chunk, are released.
        assert client.retrieve(reader, REG.instance_id, shm) == payloads
        storage.l1.expire_locks(forgotten_deadline)  # the forgotten locks expire
        assert [obj.read_locks for obj in forgotten] == [1, 1], "a released lock lives on"
        storage.release(keys)
        assert l1(server)["read_locks"] == 0


def test_an_earlier_process_unregistering_leaves_a_restarted_ones_registration(
    mp_server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``lmcache bench server`` and vLLM's workers register fixed instance ids: a restarted
    client registers the id again while the process before it may still send its
    ``unregister`` on its way out.  Each client process has a connection (ZeroMQ identity)
    of its own; only the one that made the registration in force may end it."""
    address = mp_address(mp_server)
    with MPClient(address) as earlier, MPClient(address) as restarted:
        earlier.register(REG)
        shm = restarted.register(REG)["shm_name"]  # the same id and layout: kept, now the restarted one's
        with caplog.at_level(logging.WARNING):
            assert earlier.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
        assert [entry["instance_id"] for entry in mp_server.frontends[0].status()["instances"]] == [
            REG.instance_id
        ]
        assert mp_stats(mp_server).failures["mp_stale_unregister"] == 1
        assert "unregisters ignored" in caplog.text
        payloads = stored(restarted, 22, shm)
        key = Key(tokens_of(22), "r", worker_id=0)
        assert restarted.retrieve(key, REG.instance_id, shm) == payloads
        # the restarted process ends its own registration
        assert restarted.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
        assert mp_server.frontends[0].status()["instances"] == []


def test_an_earlier_process_unregistering_leaves_a_replacing_registration(
    mp_server: TiersServer,
) -> None:
    address = mp_address(mp_server)
    with MPClient(address) as earlier, MPClient(address) as rerun:
        earlier.register(REG)
        rerun.register(replacing := Registration(model_name="other-model", hidden_dim_size=32))
        assert earlier.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
        status = mp_server.frontends[0].status()["instances"]
        assert [(entry["model_name"], entry["layout"]) for entry in status] == [
            (replacing.model_name, "bfloat16[2,2,256,32]")
        ]
        assert mp_stats(mp_server).failures["mp_stale_unregister"] == 1


def test_a_store_commit_never_finishes_another_writers_reservation(mp_server: TiersServer) -> None:
    """L1 reaps a reservation at its write TTL and may hand the key to another writer at
    once.  A commit acts on the objects its own prepare reserved, never on whatever holds
    the key by then: made visible, the other writer's reservation would be served to
    readers before its bytes are there."""
    storage = mp_server.storage
    with MPClient(mp_address(mp_server)) as client:
        client.register(REG)
        key = Key(tokens_of(23), "r", worker_id=0)
        assert len(client.call("prepare_store", key.encode(), REG.instance_id)["context"]["slots"]) == 4
        keys = list(storage.l1._table.locked)
        # L1 reaps the reservations at their deadline, in the moment between the front
        # end's own deadline check and its commit; another writer reserves the keys.
        assert storage.l1.expire_locks(time.monotonic() + storage.l1.write_ttl_s + 1) == 4
        layout = mp_server.frontends[0].shared.instances[REG.instance_id].layout_text
        other = storage.reserve_write(keys, [CHUNK] * 4, [layout] * 4)
        assert len(other) == 4
        assert client.call("commit_store", key.encode(), REG.instance_id, b"") is False
        assert [storage.l1.get(k) for k in keys] == [other[k] for k in keys]
        assert l1(mp_server)["write_locked"] == 4  # still the other writer's, unfinished
        assert mp_stats(mp_server).failures["mp_commit_lost"] == 4
        storage.abort_reserved(other)


def test_a_ping_from_a_connection_that_did_not_register_its_instance_asks_it_to(
    client: MPClient, mp_server: TiersServer
) -> None:
    """LMCache's vLLM worker re-registers (and maps this server's segment) only when its
    heartbeat sees the server unhealthy and then healthy; a server restarted between two
    pings is never seen down.  So a ping naming an instance its connection did not register
    answers false once, and true after, which makes the heartbeat register again."""
    client.register(REG)
    assert client.call("ping", REG.instance_id) is True
    with MPClient(mp_address(mp_server)) as reconnected:
        assert reconnected.call("ping", REG.instance_id) is False
        assert reconnected.call("ping", REG.instance_id) is True  # the healthy edge
        assert reconnected.call("ping", 4242) is False  # an id this server does not know
        reconnected.register(REG)
        assert reconnected.call("ping", REG.instance_id) is True
    assert mp_stats(mp_server).failures["mp_ping_asks_reregistration"] == 2
