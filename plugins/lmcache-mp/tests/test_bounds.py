"""What clients can make the front end keep, and what it counts when it drops or refuses."""

from __future__ import annotations

import logging
import time
import tracemalloc
from typing import Any

import msgspec
import pytest
from lmcache_plugin_lmcache_mp import LMCacheMPConfig, handlers, wire
from lmcache_plugin_lmcache_mp.base import Shared
from lmcache_plugin_lmcache_mp.lookups import Lookups
from lmcache_plugin_lmcache_mp.state import Instance, PendingTransfers, Transfer
from lmcache_plugin_lmcache_mp.transfers import Transfers
from lmcache_plugin_lmcache_mp.wire import CacheKey, decode_arguments, operation_name, peek_uid
from mpclient import Key, MPClient, Registration, mp_address, tokens_of, wait_for

from lmcache_tiers.plugin import FrontendStats, ObjectKey, TensorLayout
from lmcache_tiers.server.app import TiersServer

REG = Registration()


def mp_failures(server: TiersServer) -> Any:
    return server.frontends[0].stats().failures


def test_status_lists_instances_while_the_loop_registers_more(
    mp_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/status runs on an HTTP thread: a registration landing while it lists the instances
    must not make it raise "dictionary changed size during iteration"."""
    frontend = mp_server.frontends[0]
    instances = frontend.shared.instances
    layout = TensorLayout("bfloat16", (2, 2, 256, 64))
    instances[1] = Instance(1, "m", 1, layout, 0.0, 0.0)
    real = Instance.layout_text

    def registering_meanwhile(self: Instance) -> str:
        instances.setdefault(2, Instance(2, "m", 1, layout, 0.0, 0.0))  # the loop thread, interleaved
        return str(real.fget(self))  # type: ignore[attr-defined]

    monkeypatch.setattr(Instance, "layout_text", property(registering_meanwhile))
    assert [entry["instance_id"] for entry in frontend.status()["instances"]] == [1]
    monkeypatch.undo()
    instances.clear()


def test_registrations_beyond_max_instances_are_refused(
    mp_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = mp_server
    # raising=False: on a build without the bound this fails on the registrations instead
    monkeypatch.setattr(handlers, "MAX_INSTANCES", 2, raising=False)
    with MPClient(mp_address(server)) as client:
        client.register(Registration(instance_id=1))
        client.register(Registration(instance_id=2))
        assert client.unanswered(
            "register_kv_cache_engine_driven_context", Registration(instance_id=3).encode()
        )
        assert client.register(Registration(instance_id=1))  # a repeat is no new instance
        assert mp_failures(server)["mp_too_many_instances"] == 1
        assert client.call("unregister_kv_cache_engine_driven_context", 1) is None
        assert client.register(Registration(instance_id=3))  # room again
        assert sorted(server.frontends[0].shared.instances) == [2, 3]


def test_requests_forgotten_beyond_max_requests_are_counted_and_logged(
    make_mp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_mp_server(max_requests=2)
    with MPClient(mp_address(server)) as client, caplog.at_level(logging.WARNING):
        for request in range(5):
            assert client.lookup(Key(tokens_of(1), f"r{request}", model_name="nobody")) == 0
        wait_for(
            lambda: mp_failures(server)["mp_request_dropped"] == 3, "the dropped requests were not counted"
        )
        assert len(server.frontends[0].shared.requests) == 2
    assert any("mp_request_dropped" in record.getMessage() for record in caplog.records)


def test_unregisters_of_unknown_instances_log_in_bursts_and_are_counted(
    client: MPClient, mp_server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        for instance_id in range(50):
            assert client.call("unregister_kv_cache_engine_driven_context", instance_id) is None
    lines = [record for record in caplog.records if "not registered" in record.getMessage()]
    assert len(lines) == 1
    assert mp_failures(mp_server)["mp_unregister_unknown"] == 50


def _transfer(deadline: float) -> Transfer:
    return Transfer([ObjectKey("m", 0, b"\1" * 32)], deadline, "r")


def test_expired_transfers_a_commit_finds_are_counted_by_the_next_sweep() -> None:
    """A commit just past the TTL, before the sweep, drops the expired transfer: the sweep
    must still count it."""
    pending = PendingTransfers()
    keys = _transfer(0).keys
    pending.add(7, keys, _transfer(deadline=time.monotonic() - 1))
    assert pending.pop(7, "r", keys, time.monotonic()) is None
    assert len(pending.expire(time.monotonic())) == 1
    assert pending.expire(time.monotonic()) == []


class _FenceFreeL1:
    """An L1 whose reservations are never fenced (no reservation here is reaped)."""

    capacity_bytes = 1 << 20

    def fence_writers(self, objs: list[Any]) -> list[Any]:
        return []

    def writers_done(self, objs: list[Any]) -> int:
        return 0


class _LosingStorage:
    """Commits nothing: L1 reaped every reservation before its commit."""

    l1 = _FenceFreeL1()

    def commit_reserved(self, reserved: dict[Any, Any]) -> list[Any]:
        return []

    def abort_reserved(self, reserved: dict[Any, Any]) -> None:
        pass


def _transfers() -> Transfers:
    shared = Shared(
        storage=_LosingStorage(),  # type: ignore[arg-type]
        config=LMCacheMPConfig(),
        stats=FrontendStats(),
        chunk_size=256,
        shm=("segment", 1 << 20),
        pickle=None,
        lock_ttl_s=60.0,
        write_ttl_s=60.0,
    )
    layout = TensorLayout("bfloat16", (2, 2, 256, 64))
    shared.instances[REG.instance_id] = Instance(REG.instance_id, REG.model_name, 1, layout, 0.0, 0.0)
    return Transfers(shared, Lookups(shared))


def test_lost_commits_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    transfers = _transfers()
    wire_key = msgspec.msgpack.encode(Key(tokens_of(2, 512), "r", worker_id=0).encode())
    key = msgspec.msgpack.decode(wire_key, type=CacheKey)
    _, keys = transfers._resolve(key, REG.instance_id)
    reserved = dict.fromkeys(keys, object())
    transfers.writes.add(REG.instance_id, keys, Transfer(keys, time.monotonic() + 60, "r", reserved=reserved))
    with caplog.at_level(logging.WARNING):
        assert transfers.commit_store(key, REG.instance_id, b"") is False
    assert transfers.shared.stats.failures["mp_commit_lost"] == 2
    assert transfers.shared.stats.stores == 0
    assert any("mp_commit_lost" in record.getMessage() for record in caplog.records)


def test_a_pickled_commit_gives_back_its_reservation_before_it_queues_for_the_pool() -> None:
    """A commit_store carrying pickled chunks after a shared-memory prepare (a client that
    fell back) finds its reservation alive, but runs on the pool later: by then the write
    TTL may have passed, L1 reaped the reservation and another writer reserved the key,
    whose reservation an abort by key would free while it is being filled."""
    transfers = _transfers()
    aborted: list[dict[Any, Any]] = []
    transfers.storage.abort_reserved = aborted.append  # type: ignore[method-assign,assignment]
    transfers.shared.pickle = object()  # type: ignore[assignment]  # never reached: the pool does not run
    key = msgspec.msgpack.decode(
        msgspec.msgpack.encode(Key(tokens_of(2, 512), "r", worker_id=0).encode()), type=CacheKey
    )
    _, keys = transfers._resolve(key, REG.instance_id)
    reserved = dict.fromkeys(keys, object())
    transfers.writes.add(REG.instance_id, keys, Transfer(keys, time.monotonic() + 60, "r", reserved=reserved))
    transfers.commit_store(key, REG.instance_id, b"pickled chunks")
    assert aborted == [reserved]


def test_expired_transfers_of_an_unregistered_instance_are_counted() -> None:
    transfers = _transfers()
    keys = _transfer(0).keys
    transfers.writes.add(REG.instance_id, keys, _transfer(deadline=time.monotonic() - 1))
    assert transfers.drop_instance(REG.instance_id, peer=b"") == (0, 0)  # its connection's unregister
    assert transfers.shared.stats.failures["mp_transfer_expired"] == 1


def test_a_frame_limit_zeromq_cannot_take_is_a_config_error(make_mp_server: Any) -> None:
    """ZeroMQ takes the frame limit as an int64 of bytes: a larger one must be refused as
    configuration, not crash the start-up in setsockopt."""
    with pytest.raises(msgspec.ValidationError, match="max_message_mb"):
        msgspec.convert({"max_message_mb": 1 << 43}, LMCacheMPConfig)
    # The largest accepted limit starts (with a pool bound that holds one such message).
    server = make_mp_server(max_message_mb=4096, frontend_pool_max_mb=4096)
    with MPClient(mp_address(server)) as client:
        assert client.call("noop") == "OK"


def _key_with_request_configs(body: bytes) -> bytes:
    """A lookup key frame whose request_configs is ``body`` (msgpack bytes)."""
    fields = Key(tokens_of(1, 256), "r").encode()
    del fields["request_configs"]
    head = msgspec.msgpack.encode(fields)  # a fixmap: one more entry follows
    return bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("request_configs") + body


def test_a_key_costs_about_its_size_in_memory_whatever_its_request_configs() -> None:
    """request_configs is a map of anything, which the front end never reads: decoded, a
    key of a few MiB of tiny maps would take 50-70 times that in Python objects, and a
    frame of max_message_mb (1 GiB) would take the server's memory."""
    count = 1 << 20
    bomb = b"\x81\xa1x\xdd" + count.to_bytes(4, "big") + b"\x80" * count  # {"x": [{}, {}, ...]}
    frame = _key_with_request_configs(bomb)
    records = b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count  # report_block_allocation's
    tracemalloc.start()
    try:
        key, tp_size = decode_arguments("lookup", [frame, msgspec.msgpack.encode(1)])
        decode_arguments("report_block_allocation", [b"\x01", b"\xa1m", records])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (key.request_id, key.end, tp_size) == ("r", 256, 1)
    assert peak < 8 * len(frame), f"{peak} bytes of Python objects for a {len(frame)}-byte key"


def test_op_and_uid_frames_are_not_decoded_whole() -> None:
    """The op frame is decoded before anything else, the uid frame for log lines: neither
    may turn a few MiB of tiny msgpack maps into 50-70 times that in Python objects."""
    count = 1 << 20
    bomb = b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count  # [{}, {}, ...]
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            operation_name(bomb)
        assert peek_uid(bomb).startswith("0x")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(bomb), f"{peak} bytes of Python objects for a {len(bomb)}-byte frame"
    assert operation_name(msgspec.msgpack.encode("x" * 64)) == "x" * 64  # the longest name


def test_argument_frames_beyond_the_bound_are_refused_but_chunks(
    client: MPClient, mp_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_message_mb is sized for pickled chunks; a key that large would cost the server
    8 times its size in Python objects and its loop thread seconds of hashing."""
    monkeypatch.setattr(wire, "MAX_ARGUMENT_BYTES", 64 << 10)
    client.register(REG)
    huge = Key(tokens_of(1, 40_000), "r")  # 120 KB of tokens
    assert client.unanswered("lookup", huge.encode(), 1)
    assert mp_failures(mp_server)["mp_bad_request"] == 1
    small = Key(tokens_of(1, 512), "r", worker_id=0)
    # commit_store's chunks are bounded by max_message_mb only (refused here: no allow_pickle)
    assert client.call("commit_store", small.encode(), REG.instance_id, bytes(100 << 10)) is False
    assert mp_failures(mp_server)["mp_pickle_refused"] == 1


def test_an_expired_reservation_a_late_commit_found_is_counted_at_the_stop() -> None:
    """A commit just past the write TTL drops its expired reservation for the next sweep
    to count; a stop before that sweep must count it (and its keys) all the same."""
    transfers = _transfers()
    key = msgspec.msgpack.decode(
        msgspec.msgpack.encode(Key(tokens_of(2, 512), "r", worker_id=0).encode()), type=CacheKey
    )
    _, keys = transfers._resolve(key, REG.instance_id)
    expired = Transfer(keys, time.monotonic() - 1, "r", reserved=dict.fromkeys(keys, object()))
    transfers.writes.add(REG.instance_id, keys, expired)
    assert transfers.commit_store(key, REG.instance_id, b"") is False  # too late
    assert transfers.release_everything() == (0, 0)
    stats = transfers.shared.stats
    assert stats.failures["mp_transfer_expired"] == 1
    assert stats.store_keys_refused == {"reservation_expired": 2}
