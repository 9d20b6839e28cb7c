"""Request semantics through the real client against an in-process server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from native_clients import OtherProcessClient
from native_keys import keys_of

from lmcache_tiers.client import Client, ClientError, ProtocolError, RequestTimeoutError, ServerError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.testing.server import ServerHarness, until_reachable
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]


def blobs(count: int, size: int = 10_000) -> list[bytes]:
    return [os.urandom(size) for _ in range(count)]


def slow_l2(seconds: float) -> str:
    """An L2 whose lookups and loads each take ``seconds`` (a prefetch from it is still
    running when the test's next request comes); its stores are not slowed, so putting
    the keys there (a flush) does not wait."""
    inner = {"type": "mock", "max_size_gb": 0.1}
    return json.dumps(
        {"type": "fault_inject", "inner": inner, "delay_s": seconds, "delay_ops": ["lookup", "load"]}
    )


def l1(server: TiersServer) -> dict[str, int]:
    return dict(server.storage.status()["l1"])


@pytest.mark.parametrize("shm", [True, False])
def test_store_skips_present_and_repeated_keys(server: TiersServer, shm: bool) -> None:
    keys, data = keys_of(3), blobs(3)
    with Client(server.endpoint, shm=shm) as client:
        assert client.uses_shm is shm
        assert client.store(keys[:2], data[:2]) == 2
        assert client.store(keys, data) == 1  # only the third is new
        assert client.store([keys[0], keys[0]], [data[0], data[0]]) == 0
        fresh = keys_of(1)
        assert client.store(fresh * 2, [data[0], data[1]]) == 1  # a repeat within a batch is stored once
        with client.retrieve(keys + fresh) as views:
            assert [bytes(view) for view in views] == [*data, data[0]]
    assert (l1(server)["objects"], l1(server)["write_locked"], l1(server)["read_locks"]) == (4, 0, 0)


def test_store_reserve_answers_each_key_with_its_own_slot_in_order(server: TiersServer) -> None:
    # Every key new (one slot per key, in order) and a list with a key already stored and
    # one named twice (no slot for either) are answered alike: each slot is its key's.
    keys, sizes = keys_of(5), [4096 * (index + 1) for index in range(5)]
    with Client(server.endpoint) as client:
        slots = client._call(p.StoreReserve(0, "", keys[:3], sizes[:3]), p.StoreReserveReply).slots
        assert [slot.size for slot in slots] == sizes[:3]
        assert len({slot.offset for slot in slots}) == 3 and p.NO_SLOT not in {slot.offset for slot in slots}
        assert client._call(p.StoreCommit(0, "", keys[:1]), p.StoreReply).done == [True]
        mixed = [keys[0], keys[3], keys[4], keys[3]]
        slots = client._call(
            p.StoreReserve(0, "", mixed, [sizes[0], sizes[3], sizes[4], sizes[3]]), p.StoreReserveReply
        ).slots
        assert [slot.offset == p.NO_SLOT for slot in slots] == [True, False, False, True]
        assert [slot.size for slot in slots[1:3]] == sizes[3:5]
        client._call(p.StoreAbort(0, "", keys[1:]), p.StoreReply)
    assert (l1(server)["objects"], l1(server)["write_locked"]) == (1, 0)


@pytest.mark.parametrize("shm", [True, False])
def test_a_store_counts_only_what_it_stored(server: TiersServer, shm: bool) -> None:
    keys, data = keys_of(2), blobs(2)
    with Client(server.endpoint, shm=shm) as client:
        assert client.store(keys, data) == 2
        assert client.store(keys, data) == 0  # all present: nothing stored, nothing counted
    ((_, stats),) = server.frontend_stats()
    assert (stats.stores, stats.store_chunks, stats.store_bytes) == (1, 2, 2 * 10_000)


@pytest.mark.parametrize("shm", [True, False])
def test_retrieve_returns_the_prefix_and_releases_on_exit(server: TiersServer, shm: bool) -> None:
    keys, data = keys_of(4), blobs(4)
    with Client(server.endpoint, shm=shm) as client:
        client.store(keys[:2] + keys[3:], data[:2] + data[3:])  # a gap at position 2
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == data[:2]
            assert all(view.readonly for view in views)
            if shm:
                assert l1(server)["read_locks"] == 2
        assert l1(server)["read_locks"] == 0
        if shm:
            with pytest.raises(ValueError):
                bytes(views[0])  # released: no reading memory that may be reused


def test_lookup_locks_until_retrieve_or_release(server: TiersServer) -> None:
    keys, data = keys_of(3), blobs(3)
    with Client(server.endpoint) as client, Client(server.endpoint) as other:
        client.store(keys, data)
        assert client.lookup(keys) == 3
        assert l1(server)["read_locks"] == 3
        assert other.release(keys) == 0  # another client cannot drop these locks
        assert l1(server)["read_locks"] == 3
        with client.retrieve(keys) as views:
            assert len(views) == 3
        assert l1(server)["read_locks"] == 0  # the retrieve consumed the lookup's locks too
        assert client.lookup(keys[:2]) == 2
        assert client.release(keys) == 2
        assert l1(server)["read_locks"] == 0
        assert client.lookup(keys_of(2)) == 0


def test_lookup_many_pipelines_several_prompts(server: TiersServer) -> None:
    keys, data = keys_of(4), blobs(4, 100)
    with Client(server.endpoint) as client:
        client.store(keys, data)
        prompts = [keys, keys[:2], keys_of(3), keys[:3] + keys_of(1)] * 5
        assert client.lookup_many(prompts, window=3) == [4, 2, 0, 3] * 5
        client.release(keys)
    assert l1(server)["read_locks"] == 0


def test_retrieve_into_numpy_and_torch(server: TiersServer) -> None:
    keys = keys_of(2)
    tensors = [torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(128, dtype=torch.float32)]
    with Client(server.endpoint) as client, Client(server.endpoint, shm=False) as inline:
        assert client.store(keys, tensors) == 2
        for reader in (client, inline):
            out = [torch.empty_like(tensors[0]), np.empty(128, dtype=np.float32)]
            assert reader.retrieve_into(keys, out) == 2
            assert out[0].equal(tensors[0])
            assert np.array_equal(out[1], tensors[1].numpy())
        with pytest.raises(ValueError, match="too small"):
            client.retrieve_into(keys[:1], [np.empty(8, dtype=np.uint8)])
    assert l1(server)["read_locks"] == 0


def test_inline_transfers_are_split_at_the_size_limit(make_server: Factory) -> None:
    server = make_server(frontends=[{"type": "native", "max_inline_bytes": 25_000}])
    keys, data = keys_of(7), blobs(7, 10_000)
    with Client(server.endpoint, shm=False) as client:
        assert client.store(keys, data) == 7  # four requests of at most two chunks
        with client.retrieve(keys) as views:  # truncated replies, continued by the client
            assert [bytes(view) for view in views] == data
        with pytest.raises(ClientError, match="over the server's inline limit"):
            client.store(keys_of(1), [bytes(30_000)])
    assert server.frontends[0].stats().requests["StoreInline"] == 4
    assert server.frontends[0].stats().requests["Retrieve"] == 4


def test_an_inline_batch_filled_to_the_limit_fits_in_a_request(make_server: Factory) -> None:
    # max_request_bytes no larger than max_inline_bytes: a batch whose payloads reach the
    # advertised inline limit still carries its header on top.
    limits = {"max_request_bytes": 32 << 10, "max_inline_bytes": 32 << 10}
    server = make_server(frontends=[{"type": "native", **limits}])
    keys, data = keys_of(4), blobs(4, 8 << 10)
    with Client(server.endpoint, shm=False) as client:
        assert client.store(keys, data) == 4  # one request of exactly the inline limit
        assert client.store(keys_of(1), [bytes(32 << 10)]) == 1
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == data
    assert server.frontends[0].stats().failures["too_large"] == 0


def test_a_store_larger_than_l1_is_refused_whole(server: TiersServer) -> None:
    big = np.zeros(40 << 20, dtype=np.uint8)
    with Client(server.endpoint) as client:
        with pytest.raises(ServerError) as refused:
            client.store(keys_of(2), [big, big])
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
    assert (l1(server)["objects"], l1(server)["write_locked"]) == (0, 0)


def test_commit_and_abort_touch_only_the_callers_reservations(server: TiersServer) -> None:
    """Those of another process: a client of the same one names, after its connection
    dropped, those it made under its earlier identity (test_write_fence.py)."""
    keys = keys_of(2)
    with Client(server.endpoint) as owner, OtherProcessClient(server.endpoint) as stranger:
        slots = owner._call(p.StoreReserve(0, "", keys, [100, 100]), p.StoreReserveReply).slots
        assert all(slot.offset >= 0 for slot in slots)
        assert stranger._call(p.StoreCommit(0, "", keys), p.StoreReply).done == [False, False]
        assert stranger._call(p.StoreAbort(0, "", keys), p.StoreReply).done == [False, False]
        assert l1(server)["write_locked"] == 2
        assert owner._call(p.StoreAbort(0, "", keys[:1]), p.StoreReply).done == [True]
        assert owner._call(p.StoreCommit(0, "", keys), p.StoreReply).done == [False, True]
    assert (l1(server)["objects"], l1(server)["write_locked"]) == (1, 0)


def test_a_failed_copy_aborts_the_reservation(server: TiersServer) -> None:
    with Client(server.endpoint) as client:
        good = np.zeros(1000, dtype=np.uint8)
        client.store(keys_of(1), [good])
        segment = client._segment
        assert segment is not None
        original = segment.array
        segment.array = np.zeros(0, dtype=np.uint8)  # every copy now fails with a shape error
        try:
            with pytest.raises(ValueError):
                client.store(keys_of(2), [good, good])
        finally:
            segment.array = original
    assert (l1(server)["objects"], l1(server)["write_locked"]) == (1, 0)


def test_a_large_store_whose_helper_copy_fails_is_aborted_and_can_be_stored_again(
    make_server: Factory,
) -> None:
    # 4 x 8 MiB: split between the calling thread (pieces from the front) and the helper
    # (from the back); the helper's first piece fails.
    server = make_server(l1_size_gb=0.125)
    keys = keys_of(4)
    chunks = [np.random.default_rng(seed).integers(0, 256, 8 << 20, dtype=np.uint8) for seed in range(4)]
    with Client(server.endpoint) as client:
        pages = client._segment.pages if client._segment is not None else None
        assert pages is not None
        copier = pages._copier
        original_run = copier.run
        helper_took_one = threading.Event()

        def failing_run(pieces: list[Any], prepare: Callable[[int], object]) -> None:
            def prepare_or_fail(block: int) -> None:
                if threading.current_thread().name == "shm-copy":
                    helper_took_one.set()
                    raise OSError("the helper's piece failed")
                assert helper_took_one.wait(30)  # the caller does not copy everything first

            original_run(
                [(target, source, index) for index, (target, source, _) in enumerate(pieces)], prepare_or_fail
            )

        copier.run = failing_run  # type: ignore[method-assign]
        try:
            with pytest.raises(OSError, match="helper's piece failed"):
                client.store(keys, chunks)
        finally:
            copier.run = original_run  # type: ignore[method-assign]
        assert (l1(server)["objects"], l1(server)["write_locked"]) == (0, 0)
        assert client.lookup(keys) == 0
        assert client.store(keys, chunks) == 4
        targets = [np.zeros_like(chunk) for chunk in chunks]
        assert client.retrieve_into(keys, targets) == 4
        assert all(np.array_equal(chunk, target) for chunk, target in zip(chunks, targets, strict=True))


_DIES_MID_COPY = """
import os, signal, sys, threading
import numpy as np
from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
client = Client(sys.argv[1])
copier = client._segment.pages._copier
original_run = copier.run
def run(pieces, prepare):
    # the process dies before the last pieces are copied: a store half written
    def prepare_or_die(block):
        if block == len(pieces) - 2:
            os.kill(os.getpid(), signal.SIGKILL)
    original_run([(t, s, i) for i, (t, s, _) in enumerate(pieces)], prepare_or_die)
copier.run = run
keys = [ObjectKey("unit", 0, bytes.fromhex(sys.argv[2]) + bytes([i])) for i in range(4)]
client.store(keys, [np.full(8 << 20, 7, dtype=np.uint8)] * 4)
"""


def test_a_client_that_dies_mid_copy_leaves_nothing_readable_and_the_keys_storable(
    make_server: Factory,
) -> None:
    server = make_server(l1_size_gb=0.125, l1_write_ttl_s=0.5)
    prefix = os.urandom(8)
    keys = [ObjectKey("unit", 0, prefix + bytes([index])) for index in range(4)]
    child = subprocess.run(
        [sys.executable, "-c", _DIES_MID_COPY, server.endpoint, prefix.hex()], timeout=60, check=False
    )
    assert child.returncode == -signal.SIGKILL
    with Client(server.endpoint) as client:
        assert client.lookup(keys) == 0  # reserved, half written, never committed
        deadline = time.monotonic() + 30
        while l1(server)["write_locked"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert l1(server)["write_locked"] == 0  # the reservations expired
        chunks = [np.random.default_rng(seed).integers(0, 256, 8 << 20, dtype=np.uint8) for seed in range(4)]
        assert client.store(keys, chunks) == 4
        targets = [np.zeros_like(chunk) for chunk in chunks]
        assert client.retrieve_into(keys, targets) == 4
        assert all(np.array_equal(chunk, target) for chunk, target in zip(chunks, targets, strict=True))


@pytest.mark.parametrize("copy_fails", [False, True])
def test_an_inline_store_outlived_by_its_reservation_leaves_the_next_writers_alone(
    server: TiersServer, copy_fails: bool
) -> None:
    # The inline store's reservation expires while its bytes are copied in, and another
    # client reserves the key: the late commit (or abort) must not touch that reservation.
    key, theirs = keys_of(1)[0], os.urandom(10_000)
    handlers = server.frontends[0].handlers
    copier = handlers._copier_in
    with Client(server.endpoint, shm=False) as inline, Client(server.endpoint) as other:
        slots: list[p.Slot] = []

        def copier_outlived() -> Callable[[Any, memoryview], None]:
            copy_in = copier()

            def copy(obj: Any, data: memoryview) -> None:
                copy_in(obj, data)
                server.storage.l1.expire_locks(time.monotonic() + 3600)  # the write TTL passed
                slots.extend(other._call(p.StoreReserve(0, "", [key], [10_000]), p.StoreReserveReply).slots)
                if copy_fails:
                    raise KeyError("the reservation left L1")

            return copy

        handlers._copier_in = copier_outlived  # type: ignore[method-assign]
        try:
            if copy_fails:
                with pytest.raises(ServerError):
                    inline.store([key], [os.urandom(10_000)])
            else:
                assert inline.store([key], [os.urandom(10_000)]) == 0
        finally:
            handlers._copier_in = copier  # type: ignore[method-assign]
        assert slots[0].offset != p.NO_SLOT
        _left_to_its_writer(server, inline, other, key, slots[0], theirs)


def _left_to_its_writer(
    server: TiersServer, reader: Client, writer: Client, key: ObjectKey, slot: p.Slot, data: bytes
) -> None:
    """``writer``'s reservation of ``key`` (at ``slot``) is untouched: not readable, still
    write-locked, and once ``writer`` fills and commits it, ``reader`` gets ``data``."""
    assert reader.lookup([key]) == 0
    assert l1(server)["write_locked"] == 1
    segment = writer._segment
    assert segment is not None
    segment.write(slot.offset, np.frombuffer(data, dtype=np.uint8))
    assert writer._call(p.StoreCommit(0, "", [key]), p.StoreReply).done == [True]
    with reader.retrieve([key]) as views:
        assert [bytes(view) for view in views] == [data]


@pytest.mark.parametrize("commit", [True, False])
def test_a_shared_memory_commit_outlived_by_its_reservation_leaves_the_next_writers_alone(
    server: TiersServer, commit: bool
) -> None:
    # L1 reaped the reservation (its write TTL passed; the session's own deadline, read a
    # moment before L1's, has not yet when the commit comes) and another client reserved
    # the key: the late commit (or abort) must not touch that reservation.
    key, theirs = keys_of(1)[0], os.urandom(10_000)
    with Client(server.endpoint) as late, Client(server.endpoint) as other:
        mine = late._call(p.StoreReserve(0, "", [key], [10_000]), p.StoreReserveReply).slots
        assert mine[0].offset != p.NO_SLOT
        server.storage.l1.expire_locks(time.monotonic() + 3600)  # the write TTL passed
        slots = other._call(p.StoreReserve(0, "", [key], [10_000]), p.StoreReserveReply).slots
        assert slots[0].offset != p.NO_SLOT
        if commit:
            assert late._call(p.StoreCommit(0, "", [key]), p.StoreReply).done == [False]
        else:
            late._call(p.StoreAbort(0, "", [key]), p.StoreReply)
        _left_to_its_writer(server, late, other, key, slots[0], theirs)


def test_timed_out_reservations_are_given_back_when_their_reply_turns_up(server: TiersServer) -> None:
    keys = keys_of(2)
    with Client(server.endpoint) as client:
        request = p.StoreReserve(0, "", keys, [100, 100])
        with client._lock:
            client._start(request, (), deadline=float("inf"))
            # pretend the caller gave up before the reply arrived
            sent_over = client._outstanding.pop(request.req_id)
            client._remember_orphan(request, sent_over)
        client.ping()  # reads the late reply and sends the abort
        client.ping()  # the abort has been handled before this reply
    assert (l1(server)["objects"], l1(server)["write_locked"]) == (0, 0)


def test_an_empty_lookup_is_answered_without_a_request(server: TiersServer) -> None:
    with Client(server.endpoint) as client:
        assert client.lookup([]) == 0
        assert client.lookup(keys_of(1)) == 0
    assert server.frontends[0].stats().requests["Lookup"] == 1


@pytest.mark.parametrize("shm", [True, False])
def test_an_empty_store_stores_nothing_whichever_the_data_plane(server: TiersServer, shm: bool) -> None:
    # An engine with no full chunk to save (a prompt shorter than one chunk) stores nothing.
    with Client(server.endpoint, shm=shm) as client:
        assert client.uses_shm is shm
        assert client.store([], []) == 0
    assert l1(server)["objects"] == 0


def _only_in_l2(server: TiersServer, client: Client, keys: list[ObjectKey]) -> None:
    client.store(keys, blobs(len(keys)))
    assert server.storage.flush(timeout=30)
    assert client.clear() == len(keys)


def _late_reply_gives_its_locks_back(server: TiersServer, client: Client, keys: list[ObjectKey]) -> None:
    """After a call gave up: the late reply's prefix is locked for the client, and the
    next call (a ping) reads that reply and releases what it took."""
    deadline = time.monotonic() + 10
    while l1(server)["read_locks"] != len(keys):
        assert time.monotonic() < deadline, "the prefetch never finished"
        time.sleep(0.02)
    deadline = time.monotonic() + 10
    while l1(server)["read_locks"]:
        assert time.monotonic() < deadline, "the late reply's locks were never given back"
        client.ping()
    assert client.lookup(keys) == len(keys)  # the connection still pairs replies with requests
    assert client.release(keys) == len(keys)


def _give_up_on(call: str, server: TiersServer, client: Client, keys: list[ObjectKey]) -> None:
    """Send ``call`` for ``keys`` (only in L2) and give up on it before its reply comes;
    RequestTimeoutError."""
    if call == "lookup":  # the server waits for the prefetch before answering
        client._call(p.Lookup(0, "", keys, 5.0), p.LookupReply, timeout=0.05)
    handle, hits = client.start_lookup(keys)
    assert hits is None
    if call == "wait":  # the server waits for the prefetch before answering
        client._call(p.WaitPrefetchStatus(0, "", handle, 5.0), p.PrefetchStatusReply, timeout=0.05)
    deadline = time.monotonic() + 10
    while l1(server)["read_locks"] != len(keys):  # the prefetch finished; its result waits
        assert time.monotonic() < deadline, "the prefetch never finished"
        time.sleep(0.02)
    handlers = server.frontends[0].handlers
    answer = handlers._table[p.QueryPrefetchStatus]

    def stalled(req: p.QueryPrefetchStatus, identity: bytes, frames: Any) -> Any:
        time.sleep(0.5)  # the server loop stalls: the reply comes after the client gave up
        return answer(req, identity, frames)

    handlers._table[p.QueryPrefetchStatus] = stalled
    try:
        client._call(p.QueryPrefetchStatus(0, "", handle), p.PrefetchStatusReply, timeout=0.05)
    finally:
        handlers._table[p.QueryPrefetchStatus] = answer


@pytest.mark.parametrize("call", ["lookup", "wait", "query"])
def test_a_call_that_times_out_has_its_locks_given_back_when_the_reply_turns_up(
    make_server: Factory, call: str
) -> None:
    server = make_server(adapters=[slow_l2(0.3)])
    keys = keys_of(3)
    with Client(server.endpoint) as client:
        _only_in_l2(server, client, keys)
        with pytest.raises(RequestTimeoutError):
            _give_up_on(call, server, client, keys)
        _late_reply_gives_its_locks_back(server, client, keys)


def test_prefetch_from_l2_runs_off_the_loop(make_server: Factory) -> None:
    server = make_server(adapters=[slow_l2(0.5)])
    keys, data = keys_of(3), blobs(3)
    with Client(server.endpoint) as client:
        client.store(keys, data)
        assert server.storage.flush(timeout=30)
        assert client.clear() == 3
        handle, hits = client.start_lookup(keys)
        assert hits is None
        # answered while the prefetch still runs: waiting for L2 never blocks the loop
        assert client.query_prefetch(handle) is None
        assert client.wait_prefetch(handle, 30) == 3
        with pytest.raises(ServerError) as gone:
            client.query_prefetch(handle)  # collected already
        assert gone.value.code is p.ErrorCode.NOT_FOUND
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == data
        assert client.clear() == 0  # prefetched objects were temporary: freed after reading
        with pytest.raises(RequestTimeoutError):
            client.lookup(keys, timeout=0.05)
        # the abandoned prefetch is collected by the server; releasing it frees its locks
        deadline = time.monotonic() + 10
        while client.release(keys) != 3:
            assert time.monotonic() < deadline, "the abandoned prefetch was never collected"
            time.sleep(0.05)
        assert l1(server)["read_locks"] == 0


def test_shutdown_gives_back_what_clients_hold(make_server: Factory) -> None:
    server = make_server()
    keys = keys_of(3)
    with Client(server.endpoint) as client:
        client.store(keys, blobs(3))
        assert client.lookup(keys) == 3
        client._call(p.StoreReserve(0, "", keys_of(2), [10, 10]), p.StoreReserveReply)
        assert (l1(server)["read_locks"], l1(server)["write_locked"]) == (3, 2)
        server.request_stop()
        deadline = time.monotonic() + 10
        stats = server.frontends[0].stats()  # a reading, taken again until the stop shows
        while (stats.released_at_stop_locks, stats.released_at_stop_reservations) == (0, 0):
            assert time.monotonic() < deadline, "the server did not stop"
            time.sleep(0.01)
            stats = server.frontends[0].stats()
    assert (stats.released_at_stop_locks, stats.released_at_stop_reservations) == (3, 2)
    assert (l1(server)["read_locks"], l1(server)["write_locked"]) == (0, 0)


def test_unreachable_server_times_out_quickly() -> None:
    with pytest.raises(RequestTimeoutError):
        Client("tcp://127.0.0.1:9", timeout=0.2)


def test_closed_client_refuses_calls(server: TiersServer) -> None:
    client = Client(server.endpoint)
    client.close()
    client.close()
    with pytest.raises(Exception, match="closed"):
        client.ping()


def exit_code_of_a_child_forked_while_held(lock: Any, child: Callable[[], bool]) -> int:
    """Fork while another thread holds ``lock``; the child runs ``child`` (exit 0 if it
    returns True, 1 if it returns False or raises) and a hang ends it with SIGALRM."""
    holding, done = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            holding.set()
            done.wait(60)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    assert holding.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(10)
                code = 0 if child() else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        thread.join(10)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_is_refused_even_while_another_thread_was_in_a_call(server: TiersServer) -> None:
    """The child inherits the client's lock as held by a thread it does not have: its
    calls, and its close, are refused at once instead of waiting for it forever."""
    with Client(server.endpoint) as client:

        def refused_then_closed() -> bool:
            try:
                client.ping()
            except ClientError:
                client.close()
                return True
            return False

        # client._lock is what a request in progress holds
        assert exit_code_of_a_child_forked_while_held(client._lock, refused_then_closed) == 0
        assert client.ping() >= 0  # the parent's client is untouched


@pytest.mark.parametrize("held", ["mapping", "page tables"])
def test_a_forked_child_closes_while_another_thread_used_the_mapping(server: TiersServer, held: str) -> None:
    """A thread of the parent copying into the mapping, or its background population,
    holds the mapping's locks for a moment; a child forked in that moment inherits them
    held by a thread it does not have: its close must not wait for them forever."""
    with Client(server.endpoint) as client:
        segment = client._segment
        assert segment is not None
        lock = segment._state if held == "mapping" else segment.pages._idle

        def closed() -> bool:
            client.close()
            return True

        assert exit_code_of_a_child_forked_while_held(lock, closed) == 0
        keys = keys_of(1)
        assert client.store(keys, [b"after the fork"]) == 1  # the parent's mapping is untouched
        with client.retrieve(keys) as views:
            assert bytes(views[0]) == b"after the fork"


def test_wrong_reply_type_is_a_protocol_error(server: TiersServer) -> None:
    with Client(server.endpoint) as client, pytest.raises(ProtocolError):
        client._call(p.Ping(0, ""), p.StatusReply)


@pytest.mark.parametrize("shm", [True, False])
def test_layouts_travel_with_stored_objects(server: TiersServer, shm: bool) -> None:
    keys = keys_of(3)
    tensors = [torch.arange(24, dtype=torch.bfloat16).reshape(2, 12), np.ones((3, 4), dtype=np.float32)]
    with Client(server.endpoint, shm=shm) as client:
        assert client.store(keys[:2], tensors) == 2
        assert client.store(keys[2:], [b"x" * 48], layouts=["float16[4,6]"]) == 1
        with pytest.raises(ServerError, match="describes 96 bytes"):
            client._call(
                p.StoreInline(0, "", keys_of(1), ["float32[4,6]"]), p.StoreReply, payloads=[b"y" * 48]
            )
        with pytest.raises(ValueError, match="describes"):
            client.store(keys_of(1), [b"z" * 10], layouts=["float16[4]"])
    layouts = [server.storage.l1.get(key).layout for key in keys]
    assert layouts == ["bfloat16[2,12]", "float32[3,4]", "float16[4,6]"]


def _fill(client: Client, count: int, size: int) -> list[ObjectKey]:
    keys = keys_of(count)
    assert client.store(keys, [np.full(size, index, dtype=np.uint8) for index in range(count)]) == count
    return keys


@pytest.mark.parametrize(
    ("count", "size"),
    [(1, 70 << 20), (10, 8 << 20)],
    ids=["one object larger than L1", "a batch larger than L1"],
)
def test_a_store_that_cannot_fit_evicts_nothing(make_server: Factory, count: int, size: int) -> None:
    server = make_server(eviction_trigger_watermark=1.0)  # no background eviction in the way
    with Client(server.endpoint) as client:
        resident = _fill(client, 15, 4 << 20)  # 60 of the 64 MiB
        with pytest.raises(ServerError) as refused:
            client.store(keys_of(count), [np.zeros(size, dtype=np.uint8)] * count)
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
        assert client.lookup(resident) == 15  # every resident object is still there
        client.release(resident)
        assert "without evicting anything" in refused.value.server_message
    status = server.storage.status()
    assert status["eviction"]["l1"]["evicted_keys"] == 0
    assert status["failures"]["l1_write_cannot_fit"] == 1


def test_locked_objects_count_against_the_room_a_store_can_get(make_server: Factory) -> None:
    server = make_server(eviction_trigger_watermark=1.0)
    with Client(server.endpoint) as client:
        resident = _fill(client, 15, 4 << 20)
        assert client.lookup(resident[:10]) == 10  # 40 MiB read-locked: at most 24 MiB can be freed
        with pytest.raises(ServerError, match="without evicting anything"):
            client.store(keys_of(1), [np.zeros(30 << 20, dtype=np.uint8)])
        assert server.storage.status()["eviction"]["l1"]["evicted_keys"] == 0
        # what eviction can make room for is still stored, by evicting unlocked objects only
        assert client.store(keys_of(1), [np.zeros(20 << 20, dtype=np.uint8)]) == 1
        assert server.storage.status()["eviction"]["l1"]["evicted_keys"] > 0
        assert client.lookup(resident[:10]) == 10
        client.release(resident)


def test_lookups_longer_than_one_request_are_split_with_prefix_semantics(server: TiersServer) -> None:
    count = p.MAX_KEYS_PER_REQUEST + 808
    keys = keys_of(count)
    with Client(server.endpoint) as client:
        assert client.store(keys, [b"k" * 64] * count) == count
        assert client.lookup(keys) == count  # two requests, not a silent cut at the limit
        assert server.storage.l1.stats().read_locks == count
        assert client.release(keys) == count
        assert client.lookup_many([keys, keys[:10], keys_of(3)]) == [count, 10, 0]
        assert client.release(keys) == count
        gap = p.MAX_KEYS_PER_REQUEST + 100
        assert server.storage.l1.delete([keys[gap]]) == [True]
        assert client.lookup(keys) == gap
        assert client.release(keys) == gap
        with pytest.raises(ValueError, match="at most 8192 keys"):
            client.start_lookup(keys)
    assert l1(server)["read_locks"] == 0


def test_a_later_part_is_asked_only_after_a_full_hit(server: TiersServer) -> None:
    keys = keys_of(10)
    with Client(server.endpoint) as client:
        client.max_keys = 4  # as if the server took four keys per request
        client.store(keys[:6], blobs(6, 100))
        before = server.frontends[0].stats().requests["Lookup"]
        assert client.lookup(keys) == 6  # [0:4] full, [4:8] two hits: [8:10] is never asked
        assert server.frontends[0].stats().requests["Lookup"] - before == 2
        assert client.release(keys) == 6
        assert client.lookup(keys[6:]) == 0
        assert server.frontends[0].stats().requests["Lookup"] - before == 3


def test_tokens_longer_than_the_protocol_carries_are_refused_by_the_client(server: TiersServer) -> None:
    with pytest.raises(ClientError, match="limited to 256"):
        Client(server.endpoint, auth_token="t" * (p.MAX_TOKEN_LEN + 1))


@contextlib.contextmanager
def _client_of_a_server_to_restart(
    keys: list[ObjectKey], data: list[bytes]
) -> Iterator[tuple[Client, Callable[[], TiersServer]]]:
    """A client that stored ``data`` under ``keys`` in a server's shared memory, and the
    restart of that server on its port (the client's socket reconnects by itself: the
    restart returns the new server once the client reaches it)."""
    port = free_port()
    first, second = ServerHarness(), ServerHarness()

    def restart() -> TiersServer:
        first.close()
        new = second.make(port=port)
        until_reachable(client)
        return new

    try:
        client = Client(first.make(port=port).endpoint, timeout=5)
        assert client.store(keys, data) == len(keys) and client.uses_shm
        yield client, restart
    finally:
        first.close()
        second.close()


def test_a_client_follows_a_restarted_server_to_its_new_segment() -> None:
    """The socket reconnects by itself to a server restarted on the same port; the client
    must not read or write the new server's offsets in the old server's segment."""
    keys = keys_of(3)
    with _client_of_a_server_to_restart(keys, [bytes([0x11]) * 5000] * 3) as (client, restart):
        new = restart()
        with Client(new.endpoint) as other:
            fresh = [bytes([0xAA]) * 5000] * 3
            assert other.store(keys, fresh) == 3
            with client.retrieve(keys) as views:  # the old segment still says 0x11
                assert [bytes(view) for view in views] == fresh
            more = keys_of(2)
            assert client.store(more, [bytes([0x77]) * 5000] * 2) == 2  # not into the old segment
            with other.retrieve(more) as views:
                assert [bytes(view) for view in views] == [bytes([0x77]) * 5000] * 2
            out = [np.zeros(5000, dtype=np.uint8) for _ in keys]
            assert client.retrieve_into(keys, out) == 3
            assert [bytes(buffer) for buffer in out] == fresh
        assert client.uses_shm
        client.close()
        assert (l1(new)["read_locks"], l1(new)["write_locked"]) == (0, 0)


def test_views_outlive_a_close_of_their_client(server: TiersServer) -> None:
    keys, data = keys_of(3), blobs(3)
    client = Client(server.endpoint)
    assert client.store(keys, data) == 3 and client.uses_shm
    segment = client._segment
    assert segment is not None
    with client.retrieve(keys) as views:
        kept = np.frombuffer(views[0], dtype=np.uint8)  # a view the caller keeps past the block
        client.close()
        assert segment.closed and not client.uses_shm
        assert [bytes(view) for view in views] == data  # mapped until the block ends
    # the block ended as usual (no error from a generation table already unmapped)
    assert bytes(kept) == data[0]  # the mapping goes with the last view the caller kept
    with pytest.raises(ClientError, match="closed"):
        client.store(keys_of(1), blobs(1))
    with pytest.raises(Exception, match="closed"), segment.in_use():  # a closed mapping is never used again
        pass


def test_views_outlive_following_a_restarted_server() -> None:
    keys, data = keys_of(3), [bytes([0x11]) * 5000] * 3
    with _client_of_a_server_to_restart(keys, data) as (client, restart):
        old_segment = client._segment
        with client.retrieve(keys) as views:
            restart()
            more = keys_of(2)
            # follows the server: the old segment is closed while these views read it
            assert client.store(more, [bytes([0x77]) * 5000] * 2) == 2
            assert client._segment is not old_segment and old_segment is not None and old_segment.closed
            assert [bytes(view) for view in views] == data
        with client.retrieve(more) as views:  # the client goes on, on the new segment
            assert [bytes(view) for view in views] == [bytes([0x77]) * 5000] * 2
        client.close()


_CLOSED_UNDER_THREADS = """
import os, sys, threading, time
import numpy as np
from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.keys import ObjectKey
client = Client(sys.argv[1], timeout=5)
unexpected = []
def work():
    while True:
        keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(4)]
        try:
            client.store(keys, [np.ones(1 << 20, dtype=np.uint8)] * 4)
            client.retrieve_into(keys, [np.zeros(1 << 20, dtype=np.uint8) for _ in keys])
            with client.retrieve(keys) as views:
                sum(view[0] for view in views)
        except ClientError as exc:
            if "closed" in str(exc):
                return
        except BaseException as exc:
            unexpected.append(repr(exc))
            return
threads = [threading.Thread(target=work) for _ in range(2)]
for thread in threads:
    thread.start()
time.sleep(0.3)
client.close()
for thread in threads:
    thread.join(30)
print("unexpected:", unexpected)
sys.exit(1 if unexpected or any(thread.is_alive() for thread in threads) else 0)
"""


def test_closing_a_client_other_threads_use_neither_crashes_nor_confuses_them(server: TiersServer) -> None:
    # In a child: a socket closed under a thread using it used to abort the whole process.
    # Three children, each a chance at the race, run side by side, not one after another.
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CLOSED_UNDER_THREADS, server.endpoint],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for child in children:
            output, _ = child.communicate(timeout=120)
            assert child.returncode == 0, output
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


class _DropNoticedClient(Client):
    """Notices a dropped connection right after the next STORE_RESERVE or RETRIEVE reply,
    as when the server restarted while the request was on its way."""

    drop_after: tuple[type[Any], ...] = ()

    def _call(
        self, request: Any, expect: Any, payloads: Sequence[Any] = (), timeout: float | None = None
    ) -> Any:
        reply = super()._call(request, expect, payloads, timeout)
        if isinstance(request, self.drop_after):
            self.drop_after = ()
            self._dropped = True
        return reply


def test_a_reply_that_may_come_from_another_server_is_not_trusted(server: TiersServer) -> None:
    keys, data = keys_of(3), blobs(3)
    with _DropNoticedClient(server.endpoint) as client:
        client.drop_after = (p.StoreReserve,)
        assert client.store(keys, data) == 3  # reservation aborted, greeted again, stored
        assert not client._dropped
        client.drop_after = (p.Retrieve,)
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == data
        client.drop_after = (p.Retrieve,)
        out = [bytearray(10_000) for _ in keys]
        assert client.retrieve_into(keys, out) == 3
        assert [bytes(buffer) for buffer in out] == data
    stats = server.frontends[0].stats()
    assert (stats.requests["StoreAbort"], stats.requests["Hello"]) == (1, 4)
    assert (l1(server)["objects"], l1(server)["read_locks"], l1(server)["write_locked"]) == (3, 0, 0)


@pytest.mark.parametrize("shm", [True, False])
def test_lookup_locks_are_released_when_a_forced_clear_leaves_nothing_to_retrieve(
    server: TiersServer, shm: bool
) -> None:
    keys = keys_of(3)
    with Client(server.endpoint, shm=shm) as client, Client(server.endpoint) as other:
        client.store(keys, blobs(3))
        assert client.lookup(keys) == 3
        assert other.clear(force=True) == 3
        with client.retrieve(keys) as views:
            assert views == []
        # the LOOKUP's locks are gone, and with them the extents the clear held back
        assert l1(server)["read_locks"] == 0
        assert server.storage_status()["l1"]["leases"]["quarantined_extents"] == 0


def test_a_failed_lookup_gives_back_the_locks_of_the_parts_before(server: TiersServer) -> None:
    keys = keys_of(6)

    class FailingSecondPart(Client):
        def _lookup_part(self, part: list[ObjectKey], *bounds: float) -> int:
            if part[0] == keys[4]:
                raise RequestTimeoutError("the second part's prefetch did not finish")
            return super()._lookup_part(part, *bounds)

    with FailingSecondPart(server.endpoint) as client:
        client.max_keys = 4
        client.store(keys, blobs(6, 100))
        with pytest.raises(RequestTimeoutError):
            client.lookup(keys)
        client.ping()  # the release went out without waiting; it is handled before this
        assert l1(server)["read_locks"] == 0
        with pytest.raises(RequestTimeoutError):
            client.lookup_many([keys[:2], keys])
        client.ping()
        assert l1(server)["read_locks"] == 0


def test_a_slot_outside_the_arena_is_a_protocol_error_and_releases(server: TiersServer) -> None:
    keys = keys_of(2)

    class LyingServer(Client):
        def _call(
            self, request: Any, expect: Any, payloads: Sequence[Any] = (), timeout: float | None = None
        ) -> Any:
            reply = super()._call(request, expect, payloads, timeout)
            if isinstance(reply, p.RetrieveReply) and reply.slots:
                reply.slots[0] = p.Slot(1 << 40, reply.slots[0].size, reply.slots[0].generation)
            return reply

    with LyingServer(server.endpoint) as client:
        client.store(keys, blobs(2))
        with pytest.raises(ProtocolError, match="outside"), client.retrieve(keys):
            pass
    assert l1(server)["read_locks"] == 0


def test_an_inline_payload_frame_not_of_its_slots_size_is_a_protocol_error_and_releases(
    server: TiersServer,
) -> None:
    # A reply the server could not finish sending is closed with empty frames (the router):
    # one that still has the slots' frame count must not pass an empty frame for an object.
    keys = keys_of(2)

    class CutShortServer(Client):
        def _exchange(
            self, request: Any, expect: Any, payloads: Sequence[Any] = (), timeout: float | None = None
        ) -> Any:
            reply, frames = super()._exchange(request, expect, payloads, timeout)
            if isinstance(reply, p.RetrieveReply) and frames:
                frames[-1] = zmq.Frame(b"")
            return reply, frames

    with CutShortServer(server.endpoint, shm=False) as client:
        client.store(keys, blobs(2))
        with pytest.raises(ProtocolError, match="0-byte payload frame"), client.retrieve(keys):
            pass
        buffers = [np.zeros(10_000, dtype=np.uint8) for _ in keys]
        with pytest.raises(ProtocolError, match="0-byte payload frame"):
            client.retrieve_into(keys, buffers)
    assert l1(server)["read_locks"] == 0


def test_a_key_retrieved_twice_in_one_request_cannot_release_another_clients_lock(
    server: TiersServer,
) -> None:
    keys = keys_of(2)
    with Client(server.endpoint) as owner, Client(server.endpoint) as other:
        owner.store(keys, blobs(2))
        assert owner.lookup(keys) == 2  # one lock on each key, the owner's
        reply = other._call(p.Retrieve(0, "", [keys[0], keys[0], keys[1]]), p.RetrieveReply)
        assert len(reply.slots) == 3
        assert l1(server)["read_locks"] == 4  # L1 locks a key repeated in a prefix once
        assert other.release(keys) == 2
        # only the other client's own locks went: the owner's still hold its prefix
        assert l1(server)["read_locks"] == 2
        assert other.clear() == 0
        assert owner.release(keys) == 2
    assert l1(server)["read_locks"] == 0


def test_a_late_lookup_reply_gives_back_its_own_locks_not_a_retrieves(make_server: Factory) -> None:
    server = make_server(adapters=[slow_l2(0.3)])
    keys, data = keys_of(3), blobs(3)
    with Client(server.endpoint) as client, Client(server.endpoint) as other:
        client.store(keys, data)
        assert server.storage.flush(timeout=30)
        assert client.clear() == 3
        with pytest.raises(RequestTimeoutError):
            client._call(p.Lookup(0, "", keys, 5.0), p.LookupReply, timeout=0.05)
        deadline = time.monotonic() + 10
        while l1(server)["read_locks"] != 3:  # the late reply is on its way
            assert time.monotonic() < deadline, "the prefetch never finished"
            time.sleep(0.02)
        # The retrieve reads the late reply first; the release that settles it must take
        # only the timed-out lookup's locks, not those the views below are read under.
        with client.retrieve(keys) as views:
            client.ping()  # the settling release has been handled before this reply
            assert l1(server)["read_locks"] == 3
            assert other.clear() == 0  # nobody can take the objects from under the views
            assert [bytes(view) for view in views] == data
        assert l1(server)["read_locks"] == 0


def test_an_inline_copy_l1_cannot_vouch_for_ends_the_prefix(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, data = keys_of(3), blobs(3)
    storage = server.storage
    lend = storage.lend

    class LostLoan:
        def detach(self) -> bytes:
            # what L1 says of a copy whose extent may have changed hands meanwhile
            raise KeyError(f"{keys[1]} left L1 while it was being copied out")

    def racing_lend(obj: Any, *, fill: bool = False) -> Any:
        return LostLoan() if obj.key == keys[1] and not fill else lend(obj, fill=fill)

    with Client(server.endpoint, shm=False) as client:
        assert client.store(keys, data) == 3
        monkeypatch.setattr(storage, "lend", racing_lend)
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == data[:1]
    assert l1(server)["read_locks"] == 0
    ((_, stats),) = server.frontend_stats()
    assert stats.failures["retrieve_object_lost"] == 1


def test_a_prefetch_started_before_a_server_restart_is_never_another_ones(make_server: Factory) -> None:
    """A LOOKUP answered by a server that then restarts at the client's address leaves its
    caller a handle of that server.  The restarted server numbers its prefetches anew, and
    the client's next connection is a new session there: waited on now, the old handle
    must not collect the prefetch the restarted server started for this client's next
    LOOKUP (that one's hit count and locks, taken for other keys)."""
    slow = [slow_l2(0.3)]
    port = free_port()
    first = make_server(adapters=slow, port=port)
    with Client(first.endpoint, timeout=30) as client:
        before, hits = client.start_lookup(keys_of(2))  # nothing in L1: the slow L2 is asked
        assert hits is None
        first.request_stop()
        assert first.frontends[0].join(30)
        second = make_server(adapters=slow, port=port)
        theirs = keys_of(2)
        with Client(second.endpoint) as other:
            _only_in_l2(second, other, theirs)
        deadline = time.monotonic() + 60
        while True:  # the client's socket reconnects to the restarted server by itself
            try:
                client.ping(timeout=2)
                break
            except RequestTimeoutError:
                assert time.monotonic() < deadline, "the client never reached the restarted server"
        after, hits = client.start_lookup(theirs)
        assert hits is None
        with pytest.raises(ServerError) as unknown:
            client.wait_prefetch(before, 30)
        assert unknown.value.code is p.ErrorCode.NOT_FOUND
        assert client.wait_prefetch(after, 30) == 2
        assert client.release(theirs) == 2


@pytest.mark.parametrize("shm", [True, False], ids=["shared memory", "inline"])
def test_a_store_larger_than_any_free_extent_is_refused_with_its_size(
    make_server: Factory, shm: bool
) -> None:
    # Half of L1 is free, but only in 4 MiB holes between read-locked objects: an 8 MiB
    # object fits in none of them, and evicting cannot join them.
    inline_room = {"type": "native", "max_inline_bytes": 16 << 20}
    server = make_server(eviction_trigger_watermark=1.0, frontends=[inline_room])
    with Client(server.endpoint) as filler, Client(server.endpoint, shm=shm) as client:
        resident = _fill(filler, 15, 4 << 20)  # 60 of the 64 MiB, the free rest at the end
        kept, dropped = resident[1::2] + resident[-1:], resident[:-1:2]
        for key in kept:
            assert filler.lookup([key]) == 1  # read-locked: neither evicted nor moved
        assert server.storage.evict(dropped) == len(dropped)
        with pytest.raises(ServerError) as refused:
            client.store(keys_of(1), [np.zeros(8 << 20, dtype=np.uint8)])
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
        assert str(8 << 20) in refused.value.server_message  # names the size asked for
        assert "largest free extent 4194304" in refused.value.server_message
        assert [filler.lookup([key]) for key in kept] == [1] * len(kept)
        filler.release(kept)
    assert server.storage.status()["failures"]["l1_write_oom"] == 1
    assert server.frontends[0].stats().failures["out_of_memory"] == 1
    assert (l1(server)["objects"], l1(server)["write_locked"]) == (len(kept), 0)
