"""What clients can make the front end keep, and what it counts when it drops or refuses."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import pytest
from lmcache_plugin_lmcache_mp import LMCacheMPConfig, handlers
from lmcache_plugin_lmcache_mp.base import Shared
from lmcache_plugin_lmcache_mp.lookups import Lookups
from lmcache_plugin_lmcache_mp.state import Instance, PendingTransfers, Transfer
from lmcache_plugin_lmcache_mp.transfers import Transfers
from lmcache_plugin_lmcache_mp.wire import CacheKey
from mpclient import Key, MPClient, Registration, mp_address, tokens_of

from lmcache_tiers.plugin import FrontendStats, ObjectKey, TensorLayout
from lmcache_tiers.server.app import TiersServer

REG = Registration()


def mp_failures(server: TiersServer) -> Any:
    return server.frontends[0].stats().failures


def wait_for(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


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


def test_unregisters_of_unknown_instances_log_in_bursts(
    client: MPClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        for instance_id in range(50):
            assert client.call("unregister_kv_cache_engine_driven_context", instance_id) is None
    lines = [record for record in caplog.records if "not registered" in record.getMessage()]
    assert len(lines) == 1


def _transfer(deadline: float) -> Transfer:
    return Transfer([ObjectKey("m", 0, b"\1" * 32)], deadline, "r")


def test_expired_transfers_a_commit_finds_are_counted_by_the_next_sweep() -> None:
    """A commit just past the TTL, before the sweep, drops the expired transfer: the sweep
    must still count it."""
    pending = PendingTransfers()
    keys = _transfer(0).keys
    pending.add(7, keys, _transfer(deadline=time.monotonic() - 1))
    assert pending.pop(7, "r", keys, time.monotonic()) is None
    assert pending.expire(time.monotonic()) == 1
    assert pending.expire(time.monotonic()) == 0


class _LosingStorage:
    """Commits nothing: L1 reaped every reservation before its commit."""

    def commit_write(self, keys: list[Any]) -> list[bool]:
        return [False] * len(keys)

    def abort_write(self, keys: list[Any]) -> None:
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
    key = msgspec.convert(Key(tokens_of(2, 512), "r", worker_id=0).encode(), CacheKey)
    _, keys = transfers._resolve(key, REG.instance_id)
    transfers.writes.add(REG.instance_id, keys, Transfer(keys, time.monotonic() + 60, "r"))
    with caplog.at_level(logging.WARNING):
        assert transfers.commit_store(key, REG.instance_id, b"") is False
    assert transfers.shared.stats.failures["mp_commit_lost"] == 2
    assert transfers.shared.stats.stores == 0
    assert any("mp_commit_lost" in record.getMessage() for record in caplog.records)


def test_expired_transfers_of_an_unregistered_instance_are_counted() -> None:
    transfers = _transfers()
    keys = _transfer(0).keys
    transfers.writes.add(REG.instance_id, keys, _transfer(deadline=time.monotonic() - 1))
    assert transfers.drop_instance(REG.instance_id) == (0, 0)
    assert transfers.shared.stats.failures["mp_transfer_expired"] == 1
