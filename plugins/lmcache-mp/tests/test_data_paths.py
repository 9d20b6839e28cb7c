"""Where chunks come from and go to: L2, the native front end, the pickle data path."""

from __future__ import annotations

import json
import pickle
import time
from typing import Any

import pytest
import torch
from mp_slow_l2 import SLOW_L2
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, pickled_chunks, tokens_of

from lmcache_tiers.client import Client
from lmcache_tiers.keys import prefix_keys
from lmcache_tiers.plugin import kv_rank_of

REG = Registration()
CHUNK = REG.object_bytes
MOCK_L2 = [json.dumps({"type": "mock", "max_size_gb": 0.1})]


def in_l2_alone(server: Any, client: MPClient, sequence: int) -> tuple[str, list[bytes]]:
    """Register, then store request ``sequence``'s four chunks, flush them to L2 and clear
    L1: they are found in L2 alone.  The segment's name, and the payloads."""
    shm: str = client.register(REG)["shm_name"]
    payloads = chunk_payloads(sequence, 4, CHUNK)
    assert client.store(Key(tokens_of(sequence), "s", worker_id=0), REG.instance_id, payloads, shm)
    assert server.storage.flush(timeout=60)
    assert client.call("clear", True) is None
    assert server.storage.status()["l1"]["objects"] == 0
    return shm, payloads


def test_warm_lookup_from_l2_answers_on_the_first_query(make_mp_server: Any) -> None:
    # A wait far longer than the load: the lookup answers when its prefetch ends, however
    # busy the machine (the default 20 ms is shorter than a load may take there).
    server = make_mp_server(adapters=MOCK_L2, lookup_wait_ms=10_000)
    with MPClient(mp_address(server)) as client:
        shm, payloads = in_l2_alone(server, client, 1)
        # lookup waits (lookup_wait_ms) for the prefetch, so one query has the hits
        assert client.call("lookup", Key(tokens_of(1), "w").encode(), 1) is None
        assert client.call("query_prefetch_status", "w") == 4
        assert server.storage.status()["requests"]["l2_hit_chunks"] == 4
        assert client.retrieve(Key(tokens_of(1), "w", worker_id=0), REG.instance_id, shm) == payloads
        client.call("end_session", "w")
        assert server.storage.status()["l1"]["read_locks"] == 0


def test_without_the_lookup_wait_clients_poll(make_mp_server: Any) -> None:
    server = make_mp_server(adapters=MOCK_L2, lookup_wait_ms=0)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        client.call("lookup", Key(tokens_of(2), "r").encode(), 1)
        answers = [client.call("query_prefetch_status", "r")]
        deadline = time.monotonic() + 30
        while answers[-1] is None:
            assert time.monotonic() < deadline, f"the lookup's prefetch never finished: {len(answers)} polls"
            answers.append(client.call("query_prefetch_status", "r"))
        assert answers[-1] == 0
        assert client.call("wait_prefetch_status", "r", 1.0) == 0  # delivered already


def test_wait_prefetch_status_waits_for_l2(make_mp_server: Any) -> None:
    server = make_mp_server(adapters=MOCK_L2, lookup_wait_ms=0)
    with MPClient(mp_address(server)) as client:
        in_l2_alone(server, client, 3)
        client.call("lookup", Key(tokens_of(3), "w").encode(), 1)
        assert client.call("wait_prefetch_status", "w", 10.0) == 4
        client.call("end_session", "w")
        assert server.storage.status()["l1"]["read_locks"] == 0


@pytest.mark.parametrize("model", ["test-model", "meta-llama/Llama-3.1-8B"])
def test_a_chunk_stored_through_lmcache_is_read_by_the_native_client(make_mp_server: Any, model: str) -> None:
    server = make_mp_server()
    native = next(f.address for f in server.frontends if f.name.endswith(":native"))
    registration = Registration(model_name=model)
    tokens = tokens_of(4)
    with MPClient(mp_address(server)) as client:
        shm = client.register(registration)["shm_name"]
        payloads = chunk_payloads(4, 4, CHUNK)
        assert client.store(Key(tokens, "s", worker_id=0, model_name=model), REG.instance_id, payloads, shm)
    keys = prefix_keys(tokens, 256, model_name=model, kv_rank=kv_rank_of(1, 0))
    with Client(native) as reader:
        assert reader.lookup(keys) == 4
        with reader.retrieve(keys) as views:
            assert [bytes(view) for view in views] == payloads
        reader.release(keys)


def test_a_chunk_stored_through_the_native_client_hits_through_lmcache(make_mp_server: Any) -> None:
    server = make_mp_server()
    native = next(f.address for f in server.frontends if f.name.endswith(":native"))
    tokens = tokens_of(5)
    payloads = chunk_payloads(5, 4, CHUNK)
    with Client(native) as writer:
        writer.store(prefix_keys(tokens, 256, model_name="test-model", kv_rank=0x01000100), payloads)
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        assert client.lookup(Key(tokens, "r")) == 4
        assert client.retrieve(Key(tokens, "r", worker_id=0), REG.instance_id, shm) == payloads


def test_the_pickle_data_path(make_mp_server: Any) -> None:
    server = make_mp_server(shm=False, allow_pickle=True)
    with MPClient(mp_address(server)) as client:
        assert client.register(REG) == {"shm_name": "", "pool_size": 0}
        key = Key(tokens_of(6), "s", worker_id=0)
        assert client.call("prepare_store", key.encode(), REG.instance_id) == {"context": {}}
        payloads = chunk_payloads(6, 4, CHUNK)
        assert client.call("commit_store", key.encode(), REG.instance_id, pickled_chunks(payloads)) is True
        assert client.lookup(Key(tokens_of(6), "r")) == 4
        reply = client.call("prepare_retrieve", Key(tokens_of(6), "r", worker_id=0).encode(), REG.instance_id)
        assert reply["success"] is True and reply["context"] == {}
        tensors = pickle.loads(reply["data"])
        assert [t.view(torch.uint8).numpy().tobytes() for t in tensors] == payloads
        assert client.call("commit_retrieve", Key(tokens_of(6), "r", worker_id=0).encode(), REG.instance_id)
        assert server.storage.status()["l1"]["read_locks"] == 0


def test_a_pickled_connection_that_did_not_register_is_served_and_pinged_true(make_mp_server: Any) -> None:
    """Pickled chunks map no segment: another connection of a registered instance (a client
    whose ZeroMQ connection was re-established) is served as it is.  A false ping would only
    put LMCache's worker in degraded mode for a heartbeat (its in-flight retrieves failed,
    its stores dropped) for a registration it does not need."""
    server = make_mp_server(shm=False, allow_pickle=True)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
    with MPClient(mp_address(server)) as reconnected:
        assert reconnected.call("ping", REG.instance_id) is True
        key = Key(tokens_of(5), "s", worker_id=0)
        payloads = chunk_payloads(5, 4, CHUNK)
        assert (
            reconnected.call("commit_store", key.encode(), REG.instance_id, pickled_chunks(payloads)) is True
        )
        assert reconnected.call("ping", 4242) is False  # an id this server does not know
    failures = server.frontends[0].stats().failures
    assert failures["mp_ping_asks_reregistration"] == 1


def test_a_pickled_retrieve_whose_copy_l1_cannot_vouch_for_is_a_miss(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_mp_server(shm=False, allow_pickle=True)
    storage = server.storage
    lend = storage.lend

    class LostLoan:
        def detach(self) -> bytes:
            # what L1 says of a copy whose extent may have changed hands meanwhile
            raise KeyError("the object left L1 while it was being copied out")

    with MPClient(mp_address(server)) as client:
        client.register(REG)
        key = Key(tokens_of(7), "s", worker_id=0)
        client.call("prepare_store", key.encode(), REG.instance_id)
        assert client.call(
            "commit_store", key.encode(), REG.instance_id, pickled_chunks(chunk_payloads(7, 4, CHUNK))
        )
        assert client.lookup(Key(tokens_of(7), "r")) == 4
        monkeypatch.setattr(
            storage, "lend", lambda obj, *, fill=False: LostLoan() if not fill else lend(obj, fill=fill)
        )
        reply = client.call("prepare_retrieve", Key(tokens_of(7), "r", worker_id=0).encode(), REG.instance_id)
        assert reply["success"] is False and reply["data"] == b""
        stats = server.frontends[0].stats()
        assert (stats.failures["mp_retrieve_object_lost"], stats.failures["mp_handler_error"]) == (1, 0)
        client.call("end_session", "r")
        assert storage.status()["l1"]["read_locks"] == 0


def test_a_pickled_store_l1_cannot_hold_answers_false(make_mp_server: Any) -> None:
    server = make_mp_server(shm=False, allow_pickle=True, l1_size_gb=0.0007)  # room for five chunks
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        held = Key(tokens_of(9), "s", worker_id=0)
        assert client.call(
            "commit_store", held.encode(), REG.instance_id, pickled_chunks(chunk_payloads(9, 4, CHUNK))
        )
        assert client.lookup(Key(tokens_of(9), "holding")) == 4  # locked: eviction cannot take them
        key = Key(tokens_of(90), "r", worker_id=0)
        assert client.call("prepare_store", key.encode(), REG.instance_id) == {"context": {}}
        refused = pickled_chunks(chunk_payloads(90, 4, CHUNK))
        assert client.call("commit_store", key.encode(), REG.instance_id, refused) is False
        stats = server.frontends[0].stats()
        assert stats.failures["mp_store_refused_l1_full"] == 1
        assert stats.failures["mp_handler_error"] == 0
        assert client.lookup(Key(tokens_of(9), "again")) == 4  # nothing was evicted for it


class _Exploit:
    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("touch /tmp/lmcache-mp-pickle-exploit",))


def test_pickled_chunks_are_refused_unless_allowed_and_never_run_code(make_mp_server: Any) -> None:
    import os

    refusing = make_mp_server()
    with MPClient(mp_address(refusing)) as client:
        client.register(REG)
        key = Key(tokens_of(7), "s", worker_id=0)
        payloads = chunk_payloads(7, 4, CHUNK)
        assert client.call("commit_store", key.encode(), REG.instance_id, pickled_chunks(payloads)) is False
        assert refusing.frontends[0].stats().failures["mp_pickle_refused"] == 1
    allowing = make_mp_server(allow_pickle=True)
    with MPClient(mp_address(allowing)) as client:
        client.register(REG)
        key = Key(tokens_of(8), "s", worker_id=0)
        evil = pickle.dumps([_Exploit()])
        assert client.call("commit_store", key.encode(), REG.instance_id, evil) is False
        assert not os.path.exists("/tmp/lmcache-mp-pickle-exploit")
        wrong_layout = pickle.dumps([torch.zeros(3)] * 4)
        assert client.call("commit_store", key.encode(), REG.instance_id, wrong_layout) is False
        assert allowing.frontends[0].stats().failures["mp_pickle_rejected"] == 2
        assert allowing.storage.status()["l1"]["objects"] == 0


def test_a_wait_that_began_during_the_lookups_wait_gets_the_hits_when_they_come(make_mp_server: Any) -> None:
    server = make_mp_server(adapters=SLOW_L2, lookup_wait_ms=200)
    with MPClient(mp_address(server)) as client:
        in_l2_alone(server, client, 5)
        # A client that does not wait for the lookup's void reply: its wait arrives while
        # the lookup still waits for the prefetch, and outlasts that wait.
        lookup = client.send("lookup", Key(tokens_of(5), "w").encode(), 1)
        waited = client.send("wait_prefetch_status", "w", 120.0)
        assert client.receive(lookup) is None
        assert client.receive(waited, timeout_ms=20_000) == 4, "the wait missed the prefetch's end"
        client.call("end_session", "w")
        assert server.storage.status()["l1"]["read_locks"] == 0


def test_a_wait_on_a_lookup_its_request_ended_answers_at_once(make_mp_server: Any) -> None:
    server = make_mp_server(adapters=SLOW_L2, lookup_wait_ms=100)
    with MPClient(mp_address(server)) as client:
        in_l2_alone(server, client, 6)
        # The wait arrives while the lookup still waits for the prefetch, then the request
        # ends before the prefetch does: nothing will ever settle that lookup's job, so
        # the wait must not sit out its whole timeout (a pool thread, for up to forever).
        lookup = client.send("lookup", Key(tokens_of(6), "w").encode(), 1)
        waited = client.send("wait_prefetch_status", "w", 60.0)
        assert client.receive(lookup) is None
        assert client.call("end_session", "w") is None
        assert client.receive(waited, timeout_ms=5_000) == 0, "the wait outlived its ended request"
        assert server.storage.flush(timeout=30)
        deadline = time.monotonic() + 10
        while server.storage.status()["l1"]["read_locks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.storage.status()["l1"]["read_locks"] == 0


def test_a_pickled_tensor_torch_cannot_view_as_bytes_is_rejected(make_mp_server: Any) -> None:
    server = make_mp_server(shm=False, allow_pickle=True)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        key = Key(tokens_of(10, 256), "s", worker_id=0)
        shape = (2, REG.num_layers, 256, REG.hidden_dim_size)
        # Right dtype and shape, but with the negative bit set: torch refuses its byte view.
        negative = pickle.dumps([torch.zeros(shape, dtype=torch.bfloat16)._neg_view()])
        assert client.call("commit_store", key.encode(), REG.instance_id, negative) is False
        stats = server.frontends[0].stats()
        assert (stats.failures["mp_pickle_rejected"], stats.failures["mp_handler_error"]) == (1, 0)
        assert server.storage.status()["l1"]["objects"] == 0


@pytest.mark.parametrize("stall_at", [1, 4])
def test_a_pickled_store_never_commits_or_aborts_a_reservation_it_lost(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch, stall_at: int
) -> None:
    """Commits and aborts go by key: a reservation L1 reaped during the copy (the write
    TTL passed) may be another writer's by now, whose bytes are not there yet."""
    server = make_mp_server(shm=False, allow_pickle=True)
    storage = server.storage
    lend = storage.lend
    tokens = tokens_of(11)
    keys = prefix_keys(tokens, 256, model_name="test-model", kv_rank=kv_rank_of(1, 0))
    other: dict[Any, Any] = {}
    lent = [0]

    def stalled(obj: Any, *, fill: bool = False) -> Any:
        lent[0] += fill
        loan = lend(obj, fill=fill)
        if lent[0] == stall_at:
            storage.l1.expire_locks(time.monotonic() + 10_000)  # this copy outlived the write TTL
            other.update(storage.reserve_write(keys, [CHUNK] * len(keys)))  # another writer's now
        return loan

    monkeypatch.setattr(storage, "lend", stalled)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        pickled = pickled_chunks(chunk_payloads(11, 4, CHUNK))
        assert (
            client.call("commit_store", Key(tokens, "s", worker_id=0).encode(), REG.instance_id, pickled)
            is False
        )
        assert len(other) == 4
        # the other writer's reservations are neither made visible unwritten nor freed
        assert storage.status()["l1"]["write_locked"] == 4
        assert client.lookup(Key(tokens, "r")) == 0
        stats = server.frontends[0].stats()
        assert (stats.failures["mp_commit_lost"], stats.failures["mp_handler_error"]) == (4, 0)
    storage.abort_write(list(other))


def test_a_lookup_whose_prefetch_outlives_half_the_lock_ttl_is_given_up_and_counted(
    make_mp_server: Any,
) -> None:
    # Loads from L2 sleep far longer than the test waits (the sleep ends at close): the
    # sweep, at half the 1 s lock TTL, finds the prefetch still running however slow the
    # machine is.  The stop gives that load up after a short drain, not the default 10 s.
    inner = {"type": "mock", "max_size_gb": 0.1}
    slow_l2 = [json.dumps({"type": "fault_inject", "inner": inner, "delay_s": 600.0, "delay_ops": ["load"]})]
    server = make_mp_server(adapters=slow_l2, lookup_wait_ms=0, l1_lock_ttl_s=1.0, shutdown_timeout_s=0.5)
    with MPClient(mp_address(server)) as client:
        in_l2_alone(server, client, 11)
        assert client.call("lookup", Key(tokens_of(11), "slow").encode(), 1) is None
        stats = server.frontends[0].stats()
        deadline = time.monotonic() + 120.0
        while not stats.failures["mp_lookups_abandoned"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = server.frontends[0].stats()
        assert stats.failures["mp_lookups_abandoned"] == 1
        assert client.call("query_prefetch_status", "slow") == 0
        client.call("end_session", "slow")
