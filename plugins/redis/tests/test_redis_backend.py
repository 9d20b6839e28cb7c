"""What the redis adapter does beyond the conformance suite: records on a real server,
sharing a store between adapters, damaged and foreign objects, an outage and its end,
credentials, unix sockets and the configuration LMCache users write."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
import redis
from cluster_spares import ClusterSpares
from lmcache_plugin_redis import RedisConfig
from lmcache_plugin_redis import backend as backend_module
from lmcache_plugin_redis import client as client_module
from lmcache_plugin_redis import limits as limits_module
from lmcache_plugin_redis.backend import (
    KEYS_PER_TRIP,
    RedisBackend,
    glob_escape,
    trips,
)
from lmcache_plugin_redis.records import HEAD_READ, REMOVE_IF_UNCHANGED
from lmcache_plugin_redis.replies import ReplyReader
from lmcache_plugin_redis.testing import RedisClusterNodes, RedisServer, missing_reason
from lmcache_plugin_redis.writes import RecordHeaders

from lmcache_tiers.config import L2EvictionConfig, decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.circuit import CircuitBackend
from lmcache_tiers.l2.record import PREFIX_SIZE, encode_header, header_length
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.l2_restarts import _eviction_controller

WAIT_S = 30.0  # guards against hangs only


def client_of(adapter: BackendAdapter) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=WAIT_S)


def store(adapter: BackendAdapter, keys: list[ObjectKey], size: int = 4096, seed: int = 0) -> list[bytes]:
    data = [pattern(seed * 1000 + index, size) for index in range(len(keys))]
    assert client_of(adapter).store(keys, [memoryview(bytearray(d)) for d in data]) == [True] * len(keys)
    return data


def load(adapter: BackendAdapter, keys: list[ObjectKey], sizes: list[int]) -> tuple[list[bool], list[bytes]]:
    buffers = [memoryview(bytearray(size)) for size in sizes]
    ok = client_of(adapter).load(keys, buffers)
    return ok, [bytes(buffer) for buffer in buffers]


def backend_of(adapter: BackendAdapter) -> RedisBackend:
    guard = adapter.backend
    assert isinstance(guard, CircuitBackend), "the redis backend is remote: core guards it"
    assert isinstance(guard.inner, RedisBackend)
    return guard.inner


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- the stored records: one string each, core's record (header, then payload) ------------------


def header_of(raw: redis.Redis, name: str) -> bytes:
    value = raw.get(name)
    assert value is not None, f"nothing stored under {name}"
    return bytes(value[: header_length(value[:PREFIX_SIZE])])


def payload_of(raw: redis.Redis, name: str) -> bytes:
    value = raw.get(name)
    assert value is not None, f"nothing stored under {name}"
    return bytes(value[header_length(value[:PREFIX_SIZE]) :])


def put_record(raw: redis.Redis, name: str, header: bytes, payload: bytes) -> None:
    raw.set(name, header + payload)


def set_payload(raw: redis.Redis, name: str, payload: bytes) -> None:
    put_record(raw, name, header_of(raw, name), payload)


def set_header(raw: redis.Redis, name: str, header: bytes) -> None:
    put_record(raw, name, header, payload_of(raw, name))


# -- two adapters, one store ------------------------------------------------------------------


def test_an_object_stored_through_one_adapter_is_a_hit_through_another(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    first = open_adapter(url=redis_server.url, key_prefix=prefix)
    second = open_adapter(url=redis_server.url, key_prefix=prefix)
    keys = make_keys(3)
    data = store(first, keys)
    found = client_of(second).lookup_and_lock(keys)
    assert found.found == [True] * 3
    assert load(second, keys, found.sizes) == ([True] * 3, data)
    second.unlock(keys)
    # A delete through one is a miss through the other: lookups ask the store each time.
    assert first.delete(keys[:1]) == [True]
    assert client_of(second).lookup_and_lock(keys).found == [False, True, True]
    second.unlock(keys[1:])
    # An object the other replaced (another size) is read as the other wrote it.
    newer = store(second, keys[1:2], size=1000, seed=9)
    found = client_of(first).lookup_and_lock(keys[1:2])
    assert found.sizes == [1000]
    assert load(first, keys[1:2], [1000]) == ([True], newer)
    first.unlock(keys[1:2])


def test_a_load_buffer_sized_for_an_object_another_adapter_replaced_is_a_miss(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    first = open_adapter(url=redis_server.url, key_prefix=prefix)
    second = open_adapter(url=redis_server.url, key_prefix=prefix)
    keys = make_keys(1)
    store(first, keys, size=4096)
    found = client_of(first).lookup_and_lock(keys)
    store(second, keys, size=2048, seed=3)
    assert load(first, keys, found.sizes)[0] == [False]
    first.unlock(keys)
    assert first.stats().get("corrupt_records_removed", 0) == 0, "a replaced object is not damage"
    assert first.stats()["load_size_changed"] == 1, "the refused load is counted"


# -- damaged and foreign objects --------------------------------------------------------------


def _flip_a_payload_byte(raw: redis.Redis, name: str, payload: bytes) -> None:
    damaged = bytearray(payload)
    damaged[100] ^= 0xFF
    set_payload(raw, name, bytes(damaged))


def _drop_the_payload(raw: redis.Redis, name: str, payload: bytes) -> None:
    set_payload(raw, name, b"")  # a header alone: its payload is 0 bytes, it says more


def test_a_damaged_payload_is_a_miss_and_is_removed(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # (A payload of another length than its header's, or none, is found by the lookup:
    # see the test after the next.)
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    keys = make_keys(2)
    data = store(adapter, keys)
    raw = redis.Redis.from_url(redis_server.url)
    name = backend_of(adapter).name_of(keys[0])
    _flip_a_payload_byte(raw, name, data[0])
    found = client_of(adapter).lookup_and_lock(keys)
    assert found.found == [True, True], "header and length are intact: the lookup cannot tell"
    loaded, contents = load(adapter, keys, found.sizes)
    # A damaged payload is received into its buffer and fails its checksum there: the
    # buffer holds bytes nobody may read, and the load says so.
    assert (loaded, contents[1]) == ([False, True], data[1])
    adapter.unlock(keys)
    assert raw.exists(name) == 0
    assert adapter.stats()["corrupt_records_removed"] == 1
    # Its bytes released as it was removed, not found gone later (and taken for a
    # removal behind the adapter's back).
    assert adapter.used_bytes() == len(data[1])
    assert client_of(adapter).lookup_and_lock(keys[:1]).found == [False]
    assert adapter.stats().get("objects_vanished", 0) == 0


def test_a_damaged_header_is_a_lookup_miss_and_is_removed(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    keys = make_keys(1)
    store(adapter, keys)
    raw = redis.Redis.from_url(redis_server.url)
    name = backend_of(adapter).name_of(keys[0])
    header = bytearray(header_of(raw, name))
    header[-5] ^= 0x01
    set_header(raw, name, bytes(header))
    assert client_of(adapter).lookup_and_lock(keys).found == [False]
    assert raw.exists(name) == 0
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert adapter.used_bytes() == 0 and adapter.stats().get("objects_vanished", 0) == 0


#: what a forged header claims its payload is: past any capacity, yet an object's size
#: (under MAX_OBJECT_BYTES), so core would account it were the header believed
FORGED_PAYLOAD_LEN = 1 << 40


def _forged_header(header: bytes, payload_len: int) -> bytes:
    """``header`` claiming a payload of ``payload_len`` bytes, its crc made valid again:
    what a buggy writer, or damage its crc cannot see, leaves."""
    fixed = bytearray(header[:-4])
    struct.pack_into("<QQ", fixed, 12, payload_len, payload_len)  # payload_len, l1_size
    return bytes(fixed) + struct.pack("<I", zlib.crc32(fixed))


def _forge_the_length(raw: Any, name: str, payload: bytes) -> None:
    set_header(raw, name, _forged_header(header_of(raw, name), FORGED_PAYLOAD_LEN))


@pytest.mark.parametrize("damage", [_forge_the_length, _drop_the_payload])
@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_a_header_describing_a_payload_the_record_lacks_is_a_lookup_miss_never_accounted(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    mode: str,
    damage: Callable[[Any, str, bytes], None],
) -> None:
    # A header whose crc holds, claiming 1 TiB for a 4 KiB payload (or a payload that is
    # gone): believed, the lookup would account 1 TiB against a 1 GiB capacity and the
    # eviction would clear the cache for it.  The lookup compares the header with the
    # stored payload's length: the record is damage -- a miss, counted, removed.
    adapter, backend, raw = adapter_in_mode(request, prefix, open_adapter, mode, max_capacity_gb=1.0)
    keys = make_keys(2)
    data = store(adapter, keys)
    name = backend.name_of(keys[0])
    damage(raw, name, data[0])
    found = client_of(adapter).lookup_and_lock(keys)
    adapter.unlock([key for key, hit in zip(keys, found.found, strict=True) if hit])
    assert found.found == [False, True]
    assert adapter.used_bytes() == 4096, "only the intact object is accounted"
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert adapter.stats().get("lookup_objects_past_capacity", 0) == 0
    assert raw.exists(name) == 0, "damage is removed"


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_listing_leaves_out_and_removes_a_record_whose_header_its_payload_belies(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    where, raw = shared_store(request, mode)
    namer = backend_of(open_adapter(**where, key_prefix=prefix))
    keys = make_keys(2)
    names = [namer.name_of(key) for key in keys]
    for key, name in zip(keys, names, strict=True):
        payload = pattern(7, 4096)
        put_record(raw, name, encode_header(key, payload), payload)
    _forge_the_length(raw, names[0], b"")
    adapter = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    wait_for(lambda: not adapter.stats()["scan_running"], "the start-up scan")
    assert adapter.used_bytes() == 4096, "the forged size is not accounted"
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert adapter.stats().get("scan_objects_past_capacity", 0) == 0
    assert [raw.exists(name) for name in names] == [0, 1]


def _rewritten_between_the_lookups_two_commands(
    backend: RedisBackend, raw: Any, name: str, other: tuple[bytes, bytes], own: tuple[bytes, bytes]
) -> None:
    """Make the next lookup read as if, between its ``GETRANGE`` and its ``STRLEN``,
    another writer stored ``other`` (header, payload) under ``name`` -- the length is
    read of that one -- and then ``own`` again (the object the header was read of)."""

    done: list[bool] = []

    def interleave(replies: list[Any]) -> list[Any]:
        if done:  # the lookup's own trip only
            return replies
        done.append(True)
        put_record(raw, name, other[0], other[1])
        replies[1] = raw.strlen(name)
        put_record(raw, name, own[0], own[1])
        return replies

    if backend._direct is not None:
        read_headers = backend._read_headers
        backend._read_headers = lambda *args, **kwargs: interleave(read_headers(*args, **kwargs))  # type: ignore[method-assign]
    else:
        execute = backend._execute
        backend._execute = lambda *args, **kwargs: interleave(execute(*args, **kwargs))  # type: ignore[method-assign]


@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_a_record_rewritten_while_its_length_is_read_is_never_removed(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # A lookup's HGET and HSTRLEN are one trip, not one atomic read: another writer may
    # store an object of another length between them (the lookup sees a header that
    # disagrees with the length), and the first object again before the lookup acts on
    # it.  The record is then intact, its header the one read: removing it would lose an
    # acknowledged write.  A miss is safe; the removal must see the record as it is now.
    adapter, backend, raw = adapter_in_mode(request, prefix, open_adapter, mode)
    keys = make_keys(1)
    (data,) = store(adapter, keys)
    name = backend.name_of(keys[0])
    own = (header_of(raw, name), data)
    shorter = pattern(5, 1000)
    _rewritten_between_the_lookups_two_commands(
        backend, raw, name, (encode_header(keys[0], shorter), shorter), own
    )
    found = client_of(adapter).lookup_and_lock(keys)
    adapter.unlock([key for key, hit in zip(keys, found.found, strict=True) if hit])
    assert raw.exists(name) == 1, "an intact record, stored after the lookup read its header, is kept"
    assert header_of(raw, name) == own[0]
    assert found.found == [False], "header and length disagreed: a miss"


def _stored_again_after_the_loads_read(
    backend: RedisBackend, raw: Any, name: str, own: tuple[bytes, bytes]
) -> None:
    """Make the next load read the record as it is, and then -- before it acts on what
    it read -- another writer store ``own`` (header, payload) under ``name`` again: the
    same object, so the same header bytes as the damaged record the load read."""
    _after_the_loads_read(backend, lambda: put_record(raw, name, own[0], own[1]))


def _after_the_loads_read(backend: RedisBackend, meanwhile: Callable[[], Any]) -> None:
    """Make the next load read the records as they are, and ``meanwhile`` run before it
    acts on what it read (removes what it judged damaged)."""

    done: list[bool] = []

    def rewrite(result: Any) -> Any:
        if not done:  # the load's own read only, not the removal after it
            done.append(True)
            meanwhile()
        return result

    if backend._direct is not None:
        read_loads = backend._read_loads
        backend._read_loads = lambda *args, **kwargs: rewrite(read_loads(*args, **kwargs))  # type: ignore[method-assign]
    else:
        execute = backend._execute
        backend._execute = lambda *args, **kwargs: rewrite(execute(*args, **kwargs))  # type: ignore[method-assign]


def _shorten_the_payload(raw: Any, name: str, payload: bytes) -> None:
    set_payload(raw, name, payload[:1000])  # its header, intact, says 4096 bytes


@dataclass
class DamagedRecord:
    """One stored object damaged after a lookup found it (locked, of ``sizes``)."""

    adapter: BackendAdapter
    backend: RedisBackend
    raw: Any
    keys: list[ObjectKey]
    data: bytes
    name: str
    header: bytes
    sizes: Any


def _damaged_after_its_lookup(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    mode: str,
    damage: Callable[[Any, str, bytes], None],
) -> DamagedRecord:
    """Store one object on a ``mode`` adapter ("direct", "pipelined" or "cluster"), look
    it up (locking it), then ``damage`` it: the load that follows reads the damage."""
    adapter, backend, raw = adapter_in_mode(request, prefix, open_adapter, mode)
    keys = make_keys(1)
    (data,) = store(adapter, keys)
    name = backend.name_of(keys[0])
    header = header_of(raw, name)
    found = client_of(adapter).lookup_and_lock(keys)
    damage(raw, name, data)
    return DamagedRecord(adapter, backend, raw, keys, data, name, header, found.sizes)


@pytest.mark.parametrize("damage", [_flip_a_payload_byte, _drop_the_payload, _shorten_the_payload])
@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_a_record_stored_again_while_a_load_judges_it_damaged_is_never_removed(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    mode: str,
    damage: Callable[[Any, str, bytes], None],
) -> None:
    # A load reads a damaged record (a flipped payload byte, no payload, a payload of
    # another length) and removes it after the read -- on the direct path once the whole
    # batch was read.  Should the object be stored again meanwhile, the record has the
    # same header bytes as the damaged one, yet is intact: removing it would lose an
    # acknowledged write.  Only the bytes judged bad may be removed, and what is kept is
    # not counted as removed.
    record = _damaged_after_its_lookup(request, prefix, open_adapter, mode, damage)
    adapter, raw, name, data = record.adapter, record.raw, record.name, record.data
    own = (record.header, data)
    _stored_again_after_the_loads_read(record.backend, raw, name, own)
    assert load(adapter, record.keys, record.sizes)[0] == [False], "the record read was damaged: a miss"
    adapter.unlock(record.keys)
    assert (header_of(raw, name), payload_of(raw, name)) == own, "the object stored again is kept"
    stats = adapter.stats()
    assert stats.get("corrupt_records_removed", 0) == 0, "nothing was removed"
    assert stats["corrupt_records_replaced"] == 1
    found = client_of(adapter).lookup_and_lock(record.keys)
    assert load(adapter, record.keys, found.sizes) == ([True], [data])
    adapter.unlock(record.keys)


@pytest.mark.parametrize("damage", [_flip_a_payload_byte, _drop_the_payload, _shorten_the_payload])
@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_a_record_a_load_judges_damaged_is_removed_while_it_is_the_record_read(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    mode: str,
    damage: Callable[[Any, str, bytes], None],
) -> None:
    # The other side of the guard above: the damaged bytes themselves, untouched since the
    # load read them (its length, its digest), are removed and counted removed.
    record = _damaged_after_its_lookup(request, prefix, open_adapter, mode, damage)
    assert load(record.adapter, record.keys, record.sizes)[0] == [False]
    record.adapter.unlock(record.keys)
    assert record.raw.exists(record.name) == 0
    stats = record.adapter.stats()
    assert stats["corrupt_records_removed"] == 1 and stats.get("corrupt_records_replaced", 0) == 0


@pytest.mark.parametrize("damage", [_flip_a_payload_byte, _drop_the_payload, _shorten_the_payload])
def test_a_damaged_record_removed_by_another_writer_meanwhile_is_logged_as_gone(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    damage: Callable[[Any, str, bytes], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A record deleted (or evicted) between the load's read and its removal: the script
    # finds no header and removes nothing.  Not counted removed -- this server removed
    # nothing -- and the log line must not claim the object was stored again.
    record = _damaged_after_its_lookup(request, prefix, open_adapter, "direct", damage)
    _after_the_loads_read(record.backend, lambda: record.raw.delete(record.name))
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2.redis"):
        assert load(record.adapter, record.keys, record.sizes)[0] == [False]
    record.adapter.unlock(record.keys)
    assert record.raw.exists(record.name) == 0
    stats = record.adapter.stats()
    assert stats.get("corrupt_records_removed", 0) == 0 and stats["corrupt_records_replaced"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "read damaged" in r.getMessage()]
    assert "removed since" in line, line


def _drop_the_header(raw: redis.Redis, name: str, payload: bytes) -> None:
    raw.set(name, payload)  # one SET writes both: a payload alone is a stray


@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_a_payload_without_its_header_is_a_counted_miss_and_is_removed(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # A payload whose header is gone (left by an earlier layout, a hand edit, a partial
    # writer) answered every lookup and load as a plain miss, uncounted, and stayed in the
    # store for good: never listed, so never accounted nor evicted.  The lookup's GETRANGE
    # and the load's GET see a value that starts with no record header: a miss, counted,
    # removed; and the start-up listing removes it too.
    where, raw = shared_store(request, "cluster" if mode == "cluster" else "standalone")
    adapter = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    backend = backend_of(adapter)
    if mode == "pipelined":
        backend._direct = None
    keys = make_keys(4)
    data = store(adapter, keys)
    names = [backend.name_of(key) for key in keys]
    for name, payload in zip(names[:3], data, strict=False):
        _drop_the_header(raw, name, payload)
    found = client_of(adapter).lookup_and_lock(keys[:1])
    assert found.found == [False]
    assert raw.exists(names[0]) == 0, "the lookup removes it"
    assert load(adapter, keys[1:2], [4096])[0] == [False]
    assert raw.exists(names[1]) == 0, "the load removes it"
    assert adapter.stats()["corrupt_records_removed"] == 2
    listing = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    wait_for(lambda: not listing.stats()["scan_running"], "the start-up scan")
    assert [raw.exists(name) for name in names] == [0, 0, 0, 1], "the listing removes it"
    assert listing.stats()["corrupt_records_removed"] == 1
    assert listing.used_bytes() == 4096


@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_a_payload_without_its_header_stored_whole_again_meanwhile_is_never_removed(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # During a rolling upgrade another server may store the object whole between the
    # read that found the stray payload and its removal: that record is intact, and
    # removing it would lose an acknowledged write.
    adapter, backend, raw = adapter_in_mode(request, prefix, open_adapter, mode)
    keys = make_keys(1)
    (data,) = store(adapter, keys)
    name = backend.name_of(keys[0])
    own = (header_of(raw, name), data)
    _drop_the_header(raw, name, data)
    _stored_again_after_the_loads_read(backend, raw, name, own)
    assert load(adapter, keys, [4096])[0] == [False], "the record read had no header: a miss"
    assert (header_of(raw, name), payload_of(raw, name)) == own, "the object stored again is kept"
    assert adapter.stats().get("corrupt_records_removed", 0) == 0
    assert adapter.stats()["corrupt_records_replaced"] == 1
    found = client_of(adapter).lookup_and_lock(keys)
    assert load(adapter, keys, found.sizes) == ([True], [data])
    adapter.unlock(keys)


def _move_slot(nodes: list[RedisServer], slot: int, source: RedisServer, target: RedisServer) -> None:
    """Move ``slot`` and its keys from ``source`` to ``target``, as a resharding does."""
    target_id, source_id = (node.cli("CLUSTER", "MYID").stdout.strip() for node in (target, source))
    target.cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
    source.cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
    names = source.cli("CLUSTER", "GETKEYSINSLOT", str(slot), "1000").stdout.split()
    if names:
        source.cli("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *names)
    for node in (target, source, *[n for n in nodes if n not in (target, source)]):
        node.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)


def test_a_cluster_lookup_and_listing_follow_a_slot_moved_since_the_slot_map_was_read(
    redis_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A lookup's and a listing's commands go to the node the adapter's slot map names:
    # after a resharding that node answers MOVED, and the commands must reach the new one.
    where = {"startup_nodes": redis_cluster.startup_nodes, "cluster_mode": True}
    adapter = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    keys = make_keys(1)
    store(adapter, keys)
    name = backend_of(adapter).name_of(keys[0])
    raw = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    slot = raw.keyslot(name)
    source = next(n for n in redis_cluster.nodes if n.port == raw.get_node_from_key(name).port)
    target = next(n for n in redis_cluster.nodes if n is not source)
    _move_slot(redis_cluster.nodes, slot, source, target)
    try:
        stale = backend_of(adapter).client.get_node_from_key(name)  # type: ignore[union-attr]
        assert stale.port == source.port, "the adapter's slot map predates the move"
        found = client_of(adapter).lookup_and_lock(keys)
        adapter.unlock([key for key, hit in zip(keys, found.found, strict=True) if hit])
        assert (found.found, found.sizes) == ([True], [4096])
        assert dict(backend_of(adapter).list_keys()) == {keys[0]: (4096, 4096)}
    finally:
        _move_slot(redis_cluster.nodes, slot, target, source)


def shared_store(request: pytest.FixtureRequest, mode: str) -> tuple[dict[str, Any], Any]:
    """The adapter settings of a standalone store or a cluster, and a plain client on it
    (another party writing into the store)."""
    if mode == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        return {"url": server.url}, redis.Redis.from_url(server.url)
    cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster")
    where = {"startup_nodes": cluster.startup_nodes, "cluster_mode": True}
    return where, redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)


def adapter_in_mode(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    mode: str,
    **config: Any,
) -> tuple[BackendAdapter, RedisBackend, Any]:
    """(adapter, its backend, a raw client) on the shared store of ``mode``: "direct"
    (the adapter's own reply parsing), "pipelined" (the replies redis-py parses, as in
    cluster mode) or "cluster"."""
    where, raw = shared_store(request, "cluster" if mode == "cluster" else "standalone")
    adapter = open_adapter(**where, key_prefix=prefix, **config)
    backend = backend_of(adapter)
    if mode == "pipelined":
        backend._direct = None
    return adapter, backend, raw


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_record_of_another_key_under_a_colliding_name_is_a_miss_that_is_kept(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    # Two servers on one store, one prefix extending the other: the name of key "m..."
    # under prefix + "x" is the name of key "xm..." under prefix.  The record there is
    # the other server's valid object: a miss for this key, never removed as damage.
    where, raw = shared_store(request, mode)
    writer = open_adapter(**where, key_prefix=prefix)
    reader = open_adapter(**where, key_prefix=prefix + "x")
    theirs = ObjectKey("xmodel", 0, b"\x07" * 32)
    mine = ObjectKey("model", 0, b"\x07" * 32)
    name = backend_of(writer).name_of(theirs)
    assert backend_of(reader).name_of(mine) == name, "the names collide"
    data = store(writer, [theirs])
    header = header_of(raw, name)
    with caplog.at_level(logging.WARNING):
        # A load without a lookup reads the header too.
        assert load(reader, [mine], [4096])[0] == [False]
        assert raw.exists(name) == 1 and header_of(raw, name) == header, "kept by a load"
        assert client_of(reader).lookup_and_lock([mine]).found == [False]
        assert raw.exists(name) == 1 and header_of(raw, name) == header, "kept by a lookup"
    stats = reader.stats()
    assert stats.get("corrupt_records_removed", 0) == 0
    assert stats["foreign_records"] == 2
    assert any("a miss, kept" in r.getMessage() for r in caplog.records), "not logged"
    found = client_of(writer).lookup_and_lock([theirs])
    assert load(writer, [theirs], found.sizes) == ([True], data)
    writer.unlock([theirs])


def test_a_record_of_an_unknown_format_version_is_a_miss_that_is_kept(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A newer server sharing the store may write a format this one does not read: its
    # records are misses here, never removed as damage (the newer server reads them).
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    keys = make_keys(2)
    data = store(adapter, keys)
    raw = redis.Redis.from_url(redis_server.url)
    name = backend_of(adapter).name_of(keys[0])
    header = bytearray(header_of(raw, name))
    header[4:6] = (99).to_bytes(2, "little")
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")  # intact: a newer server's
    set_header(raw, name, bytes(header))
    assert client_of(adapter).lookup_and_lock(keys).found == [False, True]
    adapter.unlock(keys[1:])
    # A load without a lookup reads the header too.
    assert load(adapter, keys, [4096, 4096]) == ([False, True], [bytes(4096), data[1]])
    assert raw.exists(name) == 1 and header_of(raw, name) == bytes(header)
    stats = adapter.stats()
    assert stats["record_version_unknown"] == 2 and stats.get("corrupt_records_removed", 0) == 0


def test_a_damaged_record_the_store_refuses_to_remove_is_counted(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A user allowed to read and write objects but not to run scripts: the removal fails.
    # (Denied at start-up the adapter is refused; the ACL changes after it opened.)
    own_server.cli("ACL", "SETUSER", "tiers", "on", ">tiers-pw", "~*", "+@all")
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, username="tiers", password="tiers-pw")
    own_server.cli("ACL", "SETUSER", "tiers", "-@scripting")
    keys = make_keys(1)
    data = store(adapter, keys)
    raw = redis.Redis.from_url(own_server.url)
    _flip_a_payload_byte(raw, backend_of(adapter).name_of(keys[0]), data[0])
    assert load(adapter, keys, [4096])[0] == [False]
    stats = adapter.stats()
    # counted by what happened: the record is still there, so nothing counts as removed
    assert stats["corrupt_remove_failures"] == 1 and stats.get("corrupt_records_removed", 0) == 0


def test_a_key_holding_something_else_is_a_counted_miss_and_left_alone(
    redis_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    (key,) = make_keys(1)
    raw = redis.Redis.from_url(redis_server.url)
    name = backend_of(adapter).name_of(key)
    # Another type than a record's string (a hash: the records of the layout before this
    # one were hashes) is left alone by lookups and listings; a store replaces it.
    raw.hset(name, "field", b"somebody else's hash")
    raw.set(prefix + "not-an-object-name", b"x")
    assert client_of(adapter).lookup_and_lock([key]).found == [False]
    assert raw.hget(name, "field") == b"somebody else's hash"
    assert adapter.stats()["foreign_objects"] == 1
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2.redis"):
        assert list(adapter.iter_keys()) == []
    assert adapter.stats()["foreign_objects"] == 2
    assert adapter.stats()["listing_foreign_names"] >= 1
    told = [r.getMessage() for r in caplog.records]
    assert any("not object names of this cache" in line for line in told), told
    assert any("layout before" in line for line in told), told
    assert raw.hget(name, "field") == b"somebody else's hash"
    assert client_of(adapter).store([key], [memoryview(bytearray(10))]) == [True]
    assert client_of(adapter).lookup_and_lock([key]).found == [True]
    adapter.unlock([key])


def test_a_listing_leaves_alone_the_records_of_a_server_with_a_longer_prefix(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # Another server's prefix may extend this one's ("cache" and "cache2", "" and
    # "team."): its names are this server's names of other keys, whose records hold the
    # other server's keys -- valid objects, not damage: never listed here nor removed.
    other = open_adapter(url=redis_server.url, key_prefix=prefix + "team.")
    keys = make_keys(2)
    data = store(other, keys)
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    assert list(adapter.iter_keys()) == []
    assert adapter.stats().get("corrupt_records_removed", 0) == 0
    found = client_of(other).lookup_and_lock(keys)
    assert found.found == [True, True]
    assert load(other, keys, found.sizes) == ([True, True], data)
    other.unlock(keys)


def test_batches_larger_than_a_pipeline_trip_round_trip(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix, pipeline_max_bytes=1 << 20)
    keys = make_keys(7)
    data = store(adapter, keys, size=(1 << 20) // 2 + 1)
    found = client_of(adapter).lookup_and_lock(keys)
    assert load(adapter, keys, found.sizes) == ([True] * 7, data)
    adapter.unlock(keys)


def test_a_store_takes_the_next_trips_checksums_while_the_store_reads_this_trip(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The store reads a trip's bytes for most of the time its replies are waited for:
    # the next trip's record headers (their payload checksums) are taken then, not while
    # the store waits for that trip -- and each object's header once, by either trip.
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix, pipeline_max_bytes=1 << 16)
    backend = backend_of(adapter)
    events: list[str] = []
    record_header, status_reply = backend.context.record_header, ReplyReader.status_reply
    keys = make_keys(6)  # trips of two objects

    def header_noted(key: ObjectKey, payload: memoryview, **options: Any) -> bytes:
        if options.get("digest") is None:  # a checksum taken, not a header checked
            events.append(f"header {keys.index(key)}")
        return record_header(key, payload, **options)

    def reply_noted(reader: ReplyReader) -> Any:
        events.append("reply")
        return status_reply(reader)

    backend.context.record_header = header_noted  # type: ignore[method-assign]
    with mock.patch.object(ReplyReader, "status_reply", reply_noted):
        data = store(adapter, keys, size=30_000)
    assert events == [
        *["header 0", "header 1", "header 2", "header 3", "reply", "reply"],
        *["header 4", "header 5", "reply", "reply"],
        *["reply", "reply"],
    ]
    found = client_of(adapter).lookup_and_lock(keys)
    assert load(adapter, keys, found.sizes) == ([True] * 6, data)
    adapter.unlock(keys)


def test_a_header_that_cannot_be_made_ahead_fails_in_its_own_trip_not_the_one_read() -> None:
    # Taken ahead while the trip before waits for its replies, a header that cannot be
    # made must not fail that trip (its objects are stored): its own trip raises it.
    keys = make_keys(2)
    payloads = [memoryview(bytearray(16)), memoryview(bytearray(16))]

    class Context:
        def record_header(self, key: ObjectKey, payload: memoryview) -> bytes:
            if key == keys[1]:
                raise ValueError("record header of 70000 bytes exceeds 65536")
            return b"header"

    headers = RecordHeaders(Context(), keys, payloads)  # type: ignore[arg-type]
    headers.ahead([0, 1])
    assert headers.of(0) == b"header"
    with pytest.raises(ValueError, match="exceeds"):
        headers.of(1)


def test_a_trip_ending_on_an_object_over_a_limit_lowered_since_it_was_read_refuses_it_alone(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The store answers the object over its proto-max-bulk-len with "ERR Protocol error:
    # invalid bulk length" before closing the connection; the trip ends either on that
    # reply or, when the close resets the connection first, on the connection error --
    # which one is up to the sockets (test_store_writes.py reads the reply for certain).
    # Either way the limits are read again and the object refused alone, not counted as
    # a reply error.
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    own_server.cli("CONFIG", "SET", "proto-max-bulk-len", "1mb")
    keys = make_keys(2)
    buffers = [memoryview(bytearray(pattern(0, 4096))), memoryview(bytearray(pattern(1, (1 << 20) + 1)))]
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        assert client_of(adapter).store(keys, buffers) == [True, False]
    stats = adapter.stats()
    assert stats["store_refused_over_bulk_limit"] == 1, stats
    assert stats.get("store_reply_errors", 0) == 0, stats
    assert stats.get("backend_errors", 0) == 0, stats
    assert adapter.used_bytes() == 4096


def test_objects_that_fail_a_load_leave_the_rest_of_the_batch_loaded(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # Every kind of bad reply, between good objects, in trips of two objects: the replies
    # after each one are still read from where they start.
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix, pipeline_max_bytes=1 << 16)
    keys = make_keys(8)
    size = 40_000
    data = store(adapter, keys, size=size)
    found = client_of(adapter).lookup_and_lock(keys)
    assert found.found == [True] * 8
    raw = redis.Redis.from_url(redis_server.url)
    name = [backend_of(adapter).name_of(key) for key in keys]
    set_payload(raw, name[1], data[1][:-1])  # payload shorter than its header says: damage
    damaged = bytearray(data[3])
    damaged[size // 2] ^= 0x10
    set_payload(raw, name[3], bytes(damaged))  # payload of the right length, wrong bytes
    set_payload(raw, name[4], b"")  # a header without its payload (one SET writes both): damage
    raw.delete(name[5])
    raw.hset(name[5], "field", b"somebody else's hash")  # WRONGTYPE
    raw.delete(name[6])  # gone since the lookup
    loaded, contents = load(adapter, keys, found.sizes)
    adapter.unlock(keys)
    assert loaded == [True, False, True, False, False, False, False, True]
    assert [contents[i] for i in (0, 2, 7)] == [data[i] for i in (0, 2, 7)]
    stats = adapter.stats()
    assert stats["corrupt_records_removed"] == 3
    assert stats["foreign_objects"] == 1
    assert stats.get("backend_errors", 0) == 0, "bad objects fail alone, never the call"
    assert [raw.exists(n) for n in name] == [1, 0, 1, 0, 0, 1, 0, 1]


def test_a_load_on_a_connection_the_store_dropped_reconnects(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    keys = make_keys(2)
    data = store(adapter, keys)
    found = client_of(adapter).lookup_and_lock(keys)
    assert load(adapter, keys, found.sizes) == ([True, True], data)
    # The store drops every client connection (as a restarted server would have).
    redis_server.cli("CLIENT", "KILL", "TYPE", "normal")
    assert load(adapter, keys, found.sizes) == ([True, True], data)
    adapter.unlock(keys)
    assert client_of(adapter).lookup_and_lock(keys).found == [True, True]
    adapter.unlock(keys)
    assert adapter.stats().get("backend_errors", 0) == 0


def test_a_url_asking_for_resp3_still_looks_up_and_loads(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # redis-py takes `?protocol=3` from the url over the client's own protocol: the
    # connections whose replies the adapter reads itself must speak RESP2 regardless, or
    # every nil reply (an absent key) fails the whole lookup.
    adapter = open_adapter(url=redis_server.url + "?protocol=3", key_prefix=prefix)
    keys = make_keys(2)
    data = store(adapter, keys[:1])
    found = client_of(adapter).lookup_and_lock(keys)
    assert found.found == [True, False]
    assert load(adapter, keys[:1], found.sizes[:1]) == ([True], data)
    adapter.unlock(keys[:1])
    assert adapter.stats().get("backend_errors", 0) == 0


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, which it may pause or kill."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def spare_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterSpares]:
    if (reason := missing_reason()) is not None:
        pytest.skip(reason)
    spares = ClusterSpares(tmp_path_factory.mktemp("clusters"), depth=4)
    yield spares
    spares.close()


@pytest.fixture
def own_cluster(spare_clusters: ClusterSpares) -> Iterator[RedisClusterNodes]:
    """A cluster of the test's own, whose nodes it may pause, kill or change the ACL of:
    new, used by no other test (started ahead, while earlier tests ran)."""
    cluster = spare_clusters.take()
    try:
        yield cluster
    finally:
        cluster.stop()


def quick_failing(server: RedisServer, prefix: str, failure_threshold: int) -> dict[str, Any]:
    """Adapter fields that fail calls to a hung ``server`` fast and heal fast."""
    return {
        "url": server.url,
        "key_prefix": prefix,
        "request_timeout": 0.3,
        "connection_timeout": 0.3,
        "circuit": {"failure_threshold": failure_threshold, "probe_interval_s": 0.05},
    }


def test_a_load_from_a_hung_store_fails_in_time_and_the_next_one_after_it_answers_works(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(**quick_failing(own_server, prefix, failure_threshold=5))
    keys = make_keys(1)
    data = store(adapter, keys, size=1 << 20)
    found = client_of(adapter).lookup_and_lock(keys)
    own_server.pause()
    started = time.monotonic()
    assert load(adapter, keys, found.sizes)[0] == [False]
    assert time.monotonic() - started < 5.0, "a request timeout (and one retry) ends the load"
    assert adapter.stats()["backend_errors"] == 1
    own_server.resume()
    assert load(adapter, keys, found.sizes) == ([True], data)
    adapter.unlock(keys)


def test_a_store_whose_later_trip_fails_reports_and_accounts_what_its_earlier_ones_stored(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The store goes down between the two trips: the first trip's object is stored, and
    # must be reported and accounted as stored -- else it sits in the store, counted
    # against no capacity.
    adapter = open_adapter(
        url=own_server.url, key_prefix=prefix, pipeline_max_bytes=1 << 16, max_capacity_gb=1.0
    )
    backend = backend_of(adapter)
    execute, sent = backend._execute, []

    def down_before_the_second_trip(pipe: Any, **options: Any) -> list[Any]:
        sent.append(pipe)
        if len(sent) == 2:
            own_server.stop()
        return execute(pipe, **options)

    backend._execute = down_before_the_second_trip  # type: ignore[method-assign]
    keys = make_keys(2)
    sizes = [48 << 10, 48 << 10]
    buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
    assert client_of(adapter).store(keys, buffers) == [True, False]
    assert adapter.used_bytes() == sizes[0]
    stats = adapter.stats()
    assert stats["store_request_failures"] == 1, "the key the failed trip held is counted"
    assert stats.get("store_refused_dropped_alone", 0) == 0, stats


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_an_object_over_the_stores_bulk_limit_is_refused_alone_and_the_rest_of_its_batch_is_stored(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    # Redis closes the connection on a bulk string over proto-max-bulk-len: sent, the
    # object would fail its whole pipelined batch (small objects too) as "Broken pipe",
    # and such batches would open the circuit.  In a cluster the lowest node limit holds.
    where, raw = shared_store(request, mode)
    servers = [request.getfixturevalue("redis_server")] if mode == "standalone" else []
    servers = servers or request.getfixturevalue("redis_cluster").nodes[:1]
    with bulk_limit(servers, "1mb"):
        stored_over_the_limit(open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0), raw, caplog)


def test_a_cluster_node_that_refuses_config_get_counts_at_the_default_bulk_limit(
    redis_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One primary raised its limit, another denies this user CONFIG: that one is taken at
    # Redis's default (1 MiB here), not left out of the minimum -- the raised limit would
    # let through objects the other drops the connection for.
    monkeypatch.setattr(limits_module, "DEFAULT_BULK_LIMIT", 1 << 20)
    user = f"noconfig-{uuid.uuid4().hex[:8]}"
    for node in redis_cluster.nodes:
        rules = ["~*", "+@all", "-config"] if node is redis_cluster.nodes[1] else ["~*", "+@all"]
        node.cli("ACL", "SETUSER", user, "reset", "on", ">noconfig-pw", *rules)
    raised = redis_cluster.nodes[0]
    with bulk_limit([raised], "2mb"):
        adapter = open_adapter(
            startup_nodes=redis_cluster.startup_nodes,
            cluster_mode=True,
            key_prefix=prefix,
            username=user,
            password="noconfig-pw",
            max_capacity_gb=1.0,
        )
        raw = redis.RedisCluster(host="127.0.0.1", port=raised.port)
        stored_over_the_limit(adapter, raw, caplog)


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_bulk_limit_lowered_after_open_refuses_the_object_over_it_alone(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    # The limit read at open was 512 MiB; an operator lowers it on the running store (a
    # failover to a primary configured lower looks the same).  The connection the store
    # closes on the object over it makes the adapter read the limit again: that object
    # is refused alone, the rest of its batch stored, no call failed.
    where, raw = shared_store(request, mode)
    adapter = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    with bulk_limit(_nodes_of(request, mode), "1mb"):
        stored_over_the_limit(adapter, raw, caplog)


def test_the_circuit_probe_reads_the_stores_limits_again(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The store a probe reaches may be another (a failover) or restarted with other
    # limits: the probe reads them, so the first batch after it sends nothing over them
    # (the store answers no "Protocol error" as it drops the connection).
    # One store worker, its connection opened before the count: redis-py's connect sends
    # CLIENT SETINFO, which a Redis older than 7.2 answers with an error reply.
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0, num_workers=1)
    opened = make_keys(1, start=100)
    client_of(adapter).store(opened, [memoryview(bytearray(16))])
    adapter.delete(opened)
    own_server.cli("CONFIG", "SET", "proto-max-bulk-len", "1mb")
    backend_of(adapter).ping()
    raw = redis.Redis.from_url(own_server.url)

    def error_replies() -> int:
        return int(raw.info("stats")["total_error_replies"])

    before = error_replies()
    stored_over_the_limit(adapter, raw, caplog)
    assert error_replies() == before, "an object over the limit was sent"


@pytest.fixture
def under_a_1mb_query_buffer(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> BackendAdapter:
    """An adapter on a store whose client-query-buffer-limit is 1 MiB, read at open."""
    own_server.cli("CONFIG", "SET", "client-query-buffer-limit", "1mb")
    return open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)


def test_an_object_over_the_query_buffer_limit_is_refused_alone(
    own_server: RedisServer, under_a_1mb_query_buffer: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    # Redis reads a long argument into the query buffer whole and closes the connection
    # when it outgrows client-query-buffer-limit (1 MiB here): an object of 1 MiB is
    # under proto-max-bulk-len, yet sent it would fail its whole batch.
    adapter = under_a_1mb_query_buffer
    keys = make_keys(3)
    sizes = [4096, 1 << 20, (1 << 20) - 4096]
    buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        assert client_of(adapter).store(keys, buffers) == [True, False, True]
    backend = backend_of(adapter)
    raw = redis.Redis.from_url(own_server.url)
    assert [raw.exists(backend.name_of(key)) for key in keys] == [1, 0, 1]
    stats = adapter.stats()
    assert stats["store_refused_over_bulk_limit"] == 1, stats
    assert stats.get("backend_errors", 0) == 0, "the store failed as a whole"
    assert any("client-query-buffer-limit" in r.getMessage() for r in caplog.records), "not logged"


def test_an_object_over_the_limits_read_is_stored_once_the_store_raised_them(
    own_server: RedisServer, under_a_1mb_query_buffer: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    # The limits read at open are 1 MiB; the operator raises them with CONFIG SET.  No
    # connection drops and no probe runs then, so only the refusal itself can read them
    # again: an object the store now takes must be stored, not refused for a limit the
    # store no longer has (the refusal's log line would name that stale limit).
    adapter = under_a_1mb_query_buffer
    keys = make_keys(2)
    buffers = [memoryview(bytearray(pattern(index, 1 << 20))) for index in range(2)]
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        assert client_of(adapter).store(keys[:1], buffers[:1]) == [False]
    assert adapter.stats()["store_refused_over_bulk_limit"] == 1
    own_server.cli("CONFIG", "SET", "client-query-buffer-limit", "1gb")
    assert client_of(adapter).store(keys[1:], buffers[1:]) == [True]
    raw = redis.Redis.from_url(own_server.url)
    assert raw.exists(backend_of(adapter).name_of(keys[1])) == 1
    assert adapter.stats()["store_refused_over_bulk_limit"] == 1, "refused for a limit raised since"
    assert load(adapter, keys[1:], [1 << 20]) == ([True], [bytes(buffers[1])])


def test_a_store_dropped_after_the_probe_read_the_lowered_limit_refuses_the_object_over_it_alone(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Calls and the circuit's probe run side by side: the limits a dropped store trip
    # reads again may already have been read lower by the probe (or another call) since
    # the trip was sent.  The trip held an object over them all the same: it is sent
    # again without that object, not failed whole.
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    backend = backend_of(adapter)
    own_server.cli("CONFIG", "SET", "proto-max-bulk-len", "1mb")
    execute = backend._execute

    def probe_meanwhile(pipe: Any, **options: Any) -> list[Any]:
        try:
            return execute(pipe, **options)
        finally:
            backend.ping()  # the probe ran while the trip was on its way

    backend._execute = probe_meanwhile  # type: ignore[method-assign]
    raw = redis.Redis.from_url(own_server.url)
    stored_over_the_limit(adapter, raw, caplog)


def test_a_cluster_store_resent_after_one_node_lowered_its_limit_keeps_what_the_others_stored(
    redis_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
) -> None:
    # One primary lowers its limit after open: its connection drops on the object over
    # it, while the other primaries store theirs -- an object over the new lowest limit
    # too.  The batch is sent again, the objects over the limit refused: one the other
    # node stored already is reported stored (it is in the store, and must be accounted).
    adapter = open_adapter(
        startup_nodes=redis_cluster.startup_nodes, cluster_mode=True, key_prefix=prefix, max_capacity_gb=1.0
    )
    backend = backend_of(adapter)
    lowered = redis_cluster.nodes[0]
    client = backend.client
    assert isinstance(client, redis.RedisCluster)

    def on_lowered(key: ObjectKey) -> bool:
        return bool(client.get_node_from_key(backend.name_of(key)).port == lowered.port)

    candidates = make_keys(64)
    keys = [
        next(key for key in candidates if on_lowered(key)),
        next(key for key in candidates if not on_lowered(key)),
    ]
    sizes = [(1 << 20) + 1, (1 << 20) + 1]
    buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
    with bulk_limit([lowered], "1mb"):
        answer = client_of(adapter).store(keys, buffers)
    raw = redis.RedisCluster(host="127.0.0.1", port=lowered.port)
    present = [bool(raw.exists(backend.name_of(key))) for key in keys]
    assert present == [False, True], present
    assert answer == present, "an object in the store is reported not stored"
    assert adapter.used_bytes() == sizes[1], "the stored object is not accounted"
    assert adapter.stats()["store_refused_over_bulk_limit"] == 1, adapter.stats()


def test_limits_config_get_cannot_read_are_assumed_said_once_counted_and_an_object_over_them_fails_alone(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A managed Redis, or a user without +config: the limits cannot be read, and Redis's
    # defaults are assumed.  Whenever that starts (here: the ACL changed under a running
    # adapter, as a failover to such a store does), one line says so and it is counted --
    # the probes that find it still so say nothing more.  This store's real
    # proto-max-bulk-len is 1 MiB: an object over it fails alone (counted), nothing of it
    # is left in the store, and a lookup of it is a miss; the rest of the batch is stored.
    own_server.cli("CONFIG", "SET", "proto-max-bulk-len", "1mb")
    own_server.cli("ACL", "SETUSER", "limits", "reset", "on", ">limits-pw", "~*", "+@all")
    adapter = open_adapter(
        url=own_server.url,
        key_prefix=prefix,
        username="limits",
        password="limits-pw",
        pipeline_max_bytes=1 << 20,
        max_capacity_gb=1.0,
    )
    backend = backend_of(adapter)
    own_server.cli("ACL", "SETUSER", "limits", "-config")
    with caplog.at_level(logging.INFO, logger="lmcache_tiers.l2.redis"):
        backend.ping()
        backend.ping()
    said = [r.getMessage() for r in caplog.records if "CONFIG GET" in r.getMessage()]
    assert len(said) == 1, said
    assert f"{512 << 20}" in said[0] and f"{1 << 30}" in said[0], said[0]
    assert adapter.stats()["store_limits_assumed"] == 1
    keys = make_keys(2)
    sizes = [4096, 2 << 20]
    buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
    assert client_of(adapter).store(keys, buffers) == [True, False]
    raw = redis.Redis.from_url(own_server.url)
    assert [raw.exists(backend.name_of(key)) for key in keys] == [1, 0], "no part of it is left"
    stats = adapter.stats()
    assert stats["store_refused_dropped_alone"] == 1, stats
    assert stats.get("backend_errors", 0) == 0, "a refused object failed the call"
    assert adapter.used_bytes() == 4096
    found = client_of(adapter).lookup_and_lock(keys)
    assert found.found == [True, False]
    assert load(adapter, keys[:1], found.sizes[:1]) == ([True], [bytes(buffers[0])])
    adapter.unlock(keys[:1])
    assert adapter.stats()["store_limits_assumed"] == 1, "the reads after the drop found nothing new"


def open_without_config(
    server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> BackendAdapter:
    """An adapter on ``server`` as a user denied CONFIG (the limits are assumed at Redis's
    defaults) whose real ``client-query-buffer-limit`` is 1 MiB; the circuit opens on two
    failures, so a call counted as one is seen."""
    server.cli("CONFIG", "SET", "client-query-buffer-limit", "1mb")
    server.cli("ACL", "SETUSER", "noconfig", "reset", "on", ">noconfig-pw", "~*", "+@all", "-config")
    return open_adapter(
        url=server.url,
        key_prefix=prefix,
        max_capacity_gb=1.0,
        username="noconfig",
        password="noconfig-pw",
        circuit={"failure_threshold": 2, "probe_interval_s": 60.0},
    )


def test_a_trip_dropped_on_an_object_over_unread_limits_stores_the_rest_and_refuses_it_alone(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The store closes the connection on the 2 MiB object (over its 1 MiB query buffer
    # limit, which this user may not read), after storing the object before it in the
    # trip.  The objects are sent again one per trip: the small ones are stored and
    # accounted, the big one alone fails -- refused, not a failure of the store: twice
    # in a row it must not open the circuit.
    adapter = open_without_config(own_server, prefix, open_adapter)
    backend = backend_of(adapter)
    raw = redis.Redis.from_url(own_server.url)
    for seed in (0, 1):
        keys = make_keys(3, start=3 * seed)
        sizes = [4096, 2 << 20, 4096]
        buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
            assert client_of(adapter).store(keys, buffers) == [True, False, True]
        assert [raw.exists(backend.name_of(key)) for key in keys] == [1, 0, 1]
        found = client_of(adapter).lookup_and_lock(keys)
        assert found.found == [True, False, True]
        assert load(adapter, [keys[0]], [4096]) == ([True], [bytes(buffers[0])])
        adapter.unlock([keys[0], keys[2]])
    assert adapter.used_bytes() == 4 * 4096, "what the dropped trips stored is not accounted"
    stats = adapter.stats()
    assert stats["store_refused_dropped_alone"] == 2, stats
    assert stats.get("backend_errors", 0) == 0, stats
    assert stats.get("circuit_failures", 0) == 0, stats
    assert stats.get("store_request_failures", 0) == 0, stats
    assert any("closed the connection" in r.getMessage() for r in caplog.records), "not logged"


def test_a_trip_dropped_by_a_store_that_went_down_fails_the_call_and_refuses_nothing(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A dropped trip is taken for an object too large only while the store answers right
    # after: one that went down fails the call, counted by core, as before.
    adapter = open_without_config(own_server, prefix, open_adapter)
    client_of(adapter).store(make_keys(1, start=100), [memoryview(bytearray(16))])  # connected
    own_server.stop()
    keys = make_keys(2)
    assert client_of(adapter).store(keys, [memoryview(bytearray(4096)) for _ in keys]) == [False, False]
    stats = adapter.stats()
    assert stats.get("store_refused_dropped_alone", 0) == 0, stats
    assert stats["backend_errors"] == 1, stats


def test_a_store_that_stops_answering_while_a_dropped_trip_is_sent_again_reports_what_it_stored(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The dropped trip's objects are sent again one by one; the store goes down after the
    # first: that one is reported stored (it is there, and must be accounted), the call
    # fails for the rest, and nothing is taken for an object too large.
    adapter = open_without_config(own_server, prefix, open_adapter)
    backend = backend_of(adapter)
    execute, sent = backend._execute, []

    def down_after_the_first_sent_again(pipe: Any, **options: Any) -> list[Any]:
        sent.append(pipe)
        if len(sent) == 3:  # the trip, the first object alone: the second finds it down
            own_server.stop()
        return execute(pipe, **options)

    backend._execute = down_after_the_first_sent_again  # type: ignore[method-assign]
    keys = make_keys(3)
    sizes = [4096, 4096, 2 << 20]
    buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
    assert client_of(adapter).store(keys, buffers) == [True, False, False]
    assert adapter.used_bytes() == 4096
    stats = adapter.stats()
    assert stats.get("store_refused_dropped_alone", 0) == 0, stats
    assert stats["backend_errors"] == 1, stats


def test_a_cluster_trip_dropped_by_one_node_on_an_object_over_unread_limits_refuses_it_alone(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # One node closes the connection on the 2 MiB object (over its 1 MiB query buffer
    # limit, which this user may not read on any node): the small object that node was
    # sent before it, and the other node's, are stored and accounted; the big one alone
    # is refused, and the call does not fail.
    for node in own_cluster.nodes:
        node.cli("CONFIG", "SET", "client-query-buffer-limit", "1mb")
        node.cli("ACL", "SETUSER", "noconfig", "reset", "on", ">noconfig-pw", "~*", "+@all", "-config")
    adapter = _open_on_cluster(open_adapter, own_cluster, prefix, username="noconfig", password="noconfig-pw")
    dropping = own_cluster.nodes[0]
    candidates = make_keys(64)
    on_dropping = _on_node(adapter, own_cluster, dropping, candidates)
    here = [key for key, on in zip(candidates, on_dropping, strict=True) if on]
    elsewhere = next(key for key, on in zip(candidates, on_dropping, strict=True) if not on)
    keys = [here[0], here[1], elsewhere]
    sizes = [4096, 2 << 20, 4096]
    buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
    assert client_of(adapter).store(keys, buffers) == [True, False, True]
    backend = backend_of(adapter)
    raw = redis.RedisCluster(host="127.0.0.1", port=dropping.port)
    try:
        assert [bool(raw.exists(backend.name_of(key))) for key in keys] == [True, False, True]
    finally:
        raw.close()
    assert adapter.used_bytes() == 2 * 4096
    stats = adapter.stats()
    assert stats["store_refused_dropped_alone"] == 1, stats
    assert stats.get("backend_errors", 0) == 0, stats


def test_only_the_protocol_error_of_a_bulk_over_the_limit_counts_as_one() -> None:
    # Redis and Valkey answer "Protocol error: invalid bulk length" to a string over
    # proto-max-bulk-len just before they close the connection; their other protocol
    # errors answer requests this adapter never sends, which a smaller batch would not cure.
    assert backend_module._dropped_connection(redis.ResponseError("Protocol error: invalid bulk length"))
    assert not backend_module._dropped_connection(
        redis.ResponseError("Protocol error: invalid multibulk length")
    )
    assert not backend_module._dropped_connection(
        redis.ResponseError("Protocol error: expected '$', got 'x'")
    )


@contextlib.contextmanager
def bulk_limit(servers: list[RedisServer], limit: str) -> Iterator[None]:
    """``proto-max-bulk-len`` set to ``limit`` on the shared ``servers``, and Redis's
    default (512 MiB) again on each afterwards, whatever failed: a lower limit left on one
    would refuse the larger objects of every later test there."""
    try:
        for server in servers:
            server.cli("CONFIG", "SET", "proto-max-bulk-len", limit)
        yield
    finally:
        with contextlib.ExitStack() as restoring:  # each server's runs, errors raised after
            for server in servers:
                restoring.callback(server.cli, "CONFIG", "SET", "proto-max-bulk-len", "512mb")


def stored_over_the_limit(adapter: BackendAdapter, raw: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A batch of a small object, one of 1 MiB - 16 bytes and one of 1 MiB - 4 KiB stored
    into a store whose proto-max-bulk-len is 1 MiB: the one whose value (its record
    header, then its payload) is over it is refused alone."""
    keys = make_keys(3)
    sizes = [4096, (1 << 20) - 16, (1 << 20) - 4096]
    buffers = [memoryview(bytearray(pattern(index, size))) for index, size in enumerate(sizes)]
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        assert client_of(adapter).store(keys, buffers) == [True, False, True]
    backend = backend_of(adapter)
    assert [raw.exists(backend.name_of(key)) for key in keys] == [1, 0, 1]
    stats = adapter.stats()
    assert stats["store_refused_over_bulk_limit"] == 1
    assert stats.get("backend_errors", 0) == 0, "the store failed as a whole"
    assert any("proto-max-bulk-len" in r.getMessage() for r in caplog.records), "the refusal is not logged"
    assert adapter.used_bytes() == 4096 + (1 << 20) - 4096


def fail_pipeline(backend: Any, number: int, error: Exception) -> None:
    """Make the ``number``-th pipeline ``backend`` executes from now on raise ``error``
    (a connection dropped, no cluster node answering), the others run as they would."""
    execute, calls = backend._execute, []

    def failing(pipe: Any, **options: Any) -> list[Any]:
        calls.append(pipe)
        if len(calls) == number:
            raise error
        return execute(pipe, **options)

    backend._execute = failing


def cache_the_removal_script(backend: RedisBackend) -> None:
    """Have the store hold the delete's removal script, so every delete trip is two
    pipelines (a store that lacks it answers NOSCRIPT, and is sent it in a third)."""
    backend.client.script_load(REMOVE_IF_UNCHANGED)


def stored_for_a_two_trip_delete(
    server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> tuple[BackendAdapter, RedisBackend, list[ObjectKey]]:
    """An adapter on ``server`` holding one trip's keys and two more (16 bytes each), the
    removal script cached: a delete of them all is two trips of two pipelines each."""
    adapter = open_adapter(url=server.url, key_prefix=prefix, max_capacity_gb=1.0)
    keys = make_keys(KEYS_PER_TRIP + 2)
    store(adapter, keys, size=16)
    backend = backend_of(adapter)
    cache_the_removal_script(backend)
    return adapter, backend, keys


def test_a_delete_whose_later_trip_fails_reports_what_its_earlier_ones_deleted(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The connection drops before the second trip (a store restarting, a network cut):
    # the first trip's keys are gone and must be reported so, or core keeps their bytes.
    # (A trip is two pipelines: the headers read, then the removals.)
    adapter, backend, keys = stored_for_a_two_trip_delete(own_server, prefix, open_adapter)
    fail_pipeline(backend, 3, redis.ConnectionError("Connection closed by server."))  # trip two's reads
    assert adapter.delete(keys) == [True] * KEYS_PER_TRIP + [False, False]
    assert adapter.stats()["delete_request_failures"] == 2
    assert adapter.used_bytes() == 2 * 16


def test_a_store_whose_later_trip_finds_the_cluster_unreachable_reports_what_it_stored(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A cluster pipeline whose retries found no node raises RedisClusterUnreachableError,
    # which is no RedisError: a later trip failing so must report the earlier trips' keys
    # stored (they are in Redis) like any other failed trip, not fail the whole batch.
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    keys = make_keys(KEYS_PER_TRIP + 2)
    backend = backend_of(adapter)
    fail_pipeline(backend, 2, redis.exceptions.RedisClusterUnreachableError("no node answered"))
    buffers = [memoryview(bytearray(pattern(index, 16))) for index in range(len(keys))]
    assert client_of(adapter).store(keys, buffers) == [True] * KEYS_PER_TRIP + [False, False]
    assert adapter.stats()["store_request_failures"] == 2
    assert adapter.used_bytes() == KEYS_PER_TRIP * 16


def test_a_store_or_delete_reply_that_is_another_client_error_fails_its_key(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A cluster pipeline leaves any RedisError of a command in its reply (a redirection
    # loop's "TTL exhausted" ClusterError, an InvalidResponse): that command was not
    # done, and its key must not be reported stored (accounted, never in Redis).
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    keys = make_keys(3)
    backend = backend_of(adapter)
    execute, armed = backend._execute, [True]

    def first_reply_failed(pipe: Any, **options: Any) -> list[Any]:
        # the first reply of the call's first pipeline only (a delete runs two)
        replies = execute(pipe, **options)
        if armed:
            armed.pop()
            replies[0] = redis.exceptions.ClusterError("TTL exhausted.")
        return replies

    backend._execute = first_reply_failed  # type: ignore[method-assign]
    buffers = [memoryview(bytearray(pattern(index, 16))) for index in range(len(keys))]
    assert client_of(adapter).store(keys, buffers) == [False, True, True]
    assert adapter.stats()["store_request_failures"] == 1
    armed.append(True)
    assert adapter.delete(keys[1:]) == [False, True]
    assert adapter.stats()["delete_request_failures"] == 1


def test_a_lookup_or_load_reply_that_is_another_client_error_fails_the_call_in_one_clear_line(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A cluster pipeline leaves a client error in a command's reply (a redirection loop's
    # ClusterError): the object may be there, so the call fails (a miss, counted), and
    # its log line names that error -- not a TypeError from reading it as a header.
    adapter = open_adapter(url=own_server.url, key_prefix=prefix)
    backend = backend_of(adapter)
    backend._direct = None  # the replies redis-py parses, as in cluster mode
    keys = make_keys(2)
    store(adapter, keys)
    found = client_of(adapter).lookup_and_lock(keys)
    adapter.unlock(keys)
    new_pipeline = backend._pipeline

    def pipeline_with_a_failed_reply() -> Any:
        pipe = new_pipeline()
        execute = pipe.execute

        def failed_second_reply(**options: Any) -> list[Any]:
            replies = execute(**options)
            replies[1] = redis.exceptions.ClusterError("TTL exhausted.")
            return replies

        pipe.execute = failed_second_reply
        return pipe

    backend._pipeline = pipeline_with_a_failed_reply  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        assert client_of(adapter).lookup_and_lock(keys).found == [False, False]
        assert load(adapter, keys, found.sizes)[0] == [False, False]
    assert adapter.stats()["backend_errors"] == 2
    assert "ClusterError: TTL exhausted." in caplog.text
    assert "TypeError" not in caplog.text


def script_calls(servers: list[RedisServer]) -> tuple[int, int]:
    """EVALSHA and EVAL calls ``servers`` answered since their stats were reset."""
    totals = {"cmdstat_evalsha": 0, "cmdstat_eval": 0}
    for server in servers:
        for line in server.cli("INFO", "commandstats").stdout.splitlines():
            name, _, fields = line.partition(":")
            if name in totals:
                totals[name] += int(fields.split(",")[0].removeprefix("calls="))
    return totals["cmdstat_evalsha"], totals["cmdstat_eval"]


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_deletes_call_the_removal_script_by_digest_and_resend_it_to_a_store_that_lost_it(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # The script body is sent once per node, not once per deleted key; a store that
    # lost its scripts (restarted, SCRIPT FLUSH) answers NOSCRIPT and is sent it whole.
    # The shared servers: their scripts are flushed and their command counts reset below,
    # after which this test alone sends them commands.
    where, _ = shared_store(request, mode)
    if mode == "cluster":
        servers = list(request.getfixturevalue("redis_cluster").nodes)
    else:
        servers = [request.getfixturevalue("redis_server")]
    adapter = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    backend = backend_of(adapter)
    keys = make_keys(4)
    store(adapter, keys, size=16)
    for server in servers:
        server.cli("SCRIPT", "FLUSH")
        server.cli("CONFIG", "RESETSTAT")
    client = backend.client

    def node_of(key: ObjectKey) -> str:
        if isinstance(client, redis.RedisCluster):
            return str(client.get_node_from_key(backend.name_of(key)).name)
        return "the store"

    # the second delete's keys on a node the first delete left without the script
    first_nodes = {node_of(key) for key in keys[:2]}
    answered_noscript = 2 + sum(node_of(key) not in first_nodes for key in keys[2:])
    assert adapter.delete(keys[:2]) == [True, True], "removed after NOSCRIPT"
    assert adapter.delete(keys[2:]) == [True, True]
    assert script_calls(servers) == (4, answered_noscript), "the body sent only where the store lacked it"
    assert adapter.used_bytes() == 0


def test_a_delete_the_store_refuses_is_counted_and_logged(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A user allowed to write objects but not to remove them: each refusal is an error
    # reply, and the object stays (accounted) -- counted and explained, never silent.
    # (Denied at start-up the adapter is refused; the ACL changes after it opened.)
    own_server.cli("ACL", "SETUSER", "tiers", "on", ">tiers-pw", "~*", "+@all")
    adapter = open_adapter(
        url=own_server.url, key_prefix=prefix, username="tiers", password="tiers-pw", max_capacity_gb=1.0
    )
    own_server.cli("ACL", "SETUSER", "tiers", "-unlink")
    keys = make_keys(2)
    store(adapter, keys, size=16)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        assert adapter.delete(keys) == [False, False]
    assert adapter.stats()["delete_reply_errors"] == 2
    assert "can't run this command" in caplog.text, "the refusal is not explained"
    assert adapter.used_bytes() == 2 * 16


@pytest.mark.parametrize("cluster_path", [False, True], ids=["direct", "pipelined"])
def test_a_store_that_answers_errors_never_has_its_objects_taken_for_gone(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    cluster_path: bool,
) -> None:
    # A script running past busy-reply-threshold makes the store answer BUSY to every
    # command: the objects are there, so a lookup (or the check after a refused delete)
    # must fail rather than answer "absent" -- core would release their bytes and tell
    # the eviction policy they were deleted.
    own_server.cli("CONFIG", "SET", "busy-reply-threshold", "10")
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    if cluster_path:  # the replies redis-py parses, as in cluster mode
        backend_of(adapter)._direct = None
    keys = make_keys(2)
    data = store(adapter, keys)
    used = adapter.used_bytes()
    script = subprocess.Popen(
        ["redis-cli", "-p", str(own_server.port), "EVAL", "while true do end", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: own_server.cli("PING").stdout.startswith("BUSY"), "the store to be busy")
        assert client_of(adapter).lookup_and_lock(keys).found == [False, False]
        assert adapter.delete(keys) == [False, False]
        stats = adapter.stats()
        assert stats.get("objects_vanished", 0) == 0, "objects the store still holds were taken for gone"
        assert adapter.used_bytes() == used
        assert stats["backend_errors"] >= 1, "an error answer fails the call, as the circuit must see"
    finally:
        own_server.cli("SCRIPT", "KILL", check=False)
        script.wait(WAIT_S)
    found = client_of(adapter).lookup_and_lock(keys)
    assert load(adapter, keys, found.sizes) == ([True, True], data)
    adapter.unlock(keys)


def test_closing_ends_a_load_waiting_on_a_hung_store(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, request_timeout=60.0)
    keys = make_keys(1)
    store(adapter, keys)
    found = client_of(adapter).lookup_and_lock(keys)
    own_server.pause()
    task = adapter.submit_load(keys, [memoryview(bytearray(found.sizes[0]))])
    time.sleep(0.2)  # the load is waiting for its reply
    started = time.monotonic()
    adapter.close()
    assert time.monotonic() - started < 10.0, "close interrupts the waiting load"
    assert adapter.pop_completed_loads() == {task: [False]}


def test_closing_ends_a_store_waiting_on_a_hung_store(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # Stores go through redis-py's pool, whose retry would connect again after close()
    # shut the connection, and wait on the hung store once more.
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, request_timeout=60.0)
    store(adapter, make_keys(1))  # a pooled connection exists
    own_server.pause()
    task = adapter.submit_store(make_keys(1, start=1), [memoryview(bytearray(4096))])
    time.sleep(0.2)  # the store is waiting for its reply
    started = time.monotonic()
    adapter.close()
    assert time.monotonic() - started < 10.0, "close interrupts the waiting store"
    assert adapter.pop_completed_stores() == {task: [False]}
    own_server.resume()


def test_closing_closes_every_connection_to_the_store(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    def adapter_connections() -> int:
        # every client but the one asking (redis-cli)
        return len(own_server.cli("CLIENT", "LIST").stdout.strip().splitlines()) - 1

    adapter = open_adapter(url=own_server.url, key_prefix=prefix, num_workers=2)
    keys = make_keys(4)
    data = store(adapter, keys)  # through the pool
    found = client_of(adapter).lookup_and_lock(keys)  # on the workers' own connections
    assert load(adapter, keys, found.sizes) == ([True] * 4, data)
    adapter.unlock(keys)
    assert adapter_connections() > 0
    adapter.close()
    wait_for(lambda: adapter_connections() == 0, "the store to see every connection closed")


def test_closing_closes_every_connection_to_every_cluster_node(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:

    def adapter_connections() -> list[int]:
        return [len(node.cli("CLIENT", "LIST").stdout.strip().splitlines()) - 1 for node in own_cluster.nodes]

    adapter = open_adapter(startup_nodes=own_cluster.startup_nodes, cluster_mode=True, key_prefix=prefix)
    keys = make_keys(6)
    data = store(adapter, keys)
    found = client_of(adapter).lookup_and_lock(keys)
    assert load(adapter, keys, found.sizes) == ([True] * 6, data)
    adapter.unlock(keys)
    assert sum(adapter_connections()) > 0
    adapter.close()
    wait_for(lambda: adapter_connections() == [0, 0, 0], "every node to see its connections closed")


def _open_on_cluster(
    open_adapter: Callable[..., BackendAdapter], cluster: RedisClusterNodes, prefix: str, **settings: Any
) -> BackendAdapter:
    """An adapter on ``cluster`` whose circuit stays closed through a test's failed calls."""
    return open_adapter(
        startup_nodes=cluster.startup_nodes,
        cluster_mode=True,
        key_prefix=prefix,
        max_capacity_gb=1.0,
        circuit={"failure_threshold": 100},
        **settings,
    )


def _on_node(
    adapter: BackendAdapter, cluster: RedisClusterNodes, node: RedisServer, keys: list[ObjectKey]
) -> list[bool]:
    """Per key, whether its object lives on cluster node ``node``."""
    backend = backend_of(adapter)
    raw = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        return [raw.get_node_from_key(backend.name_of(key)).port == node.port for key in keys]
    finally:
        raw.close()


def test_a_cluster_store_whose_trip_lost_a_hung_nodes_keys_reports_its_later_trips_stored(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The first trip's key on the hung node fails alone; the later trips, on the nodes
    # that answer, are stored and must be reported so (else they sit in the store
    # counted against no capacity).
    hung = own_cluster.nodes[1]
    adapter = _open_on_cluster(
        open_adapter,
        own_cluster,
        prefix,
        request_timeout=0.3,
        connection_timeout=0.3,
        pipeline_max_bytes=1 << 16,
    )
    candidates = make_keys(64)
    on_hung = _on_node(adapter, own_cluster, hung, candidates)
    elsewhere = [key for key, on in zip(candidates, on_hung, strict=True) if not on]
    keys = [candidates[on_hung.index(True)], *elsewhere[:3]]  # trips of two 32 KiB objects
    buffers = [memoryview(bytearray(pattern(index, 1 << 15))) for index in range(len(keys))]
    hung.pause()
    try:
        stored = BlockingAdapterClient(adapter, timeout=120).store(keys, buffers)
    finally:
        hung.resume()
    assert stored == [False, True, True, True]
    assert adapter.used_bytes() == 3 << 15
    assert adapter.stats()["store_request_failures"] == 1, adapter.stats()


def test_a_cluster_batch_with_one_node_hung_reports_and_accounts_what_the_others_did(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # One trip reaches every node: the nodes that answered stored (removed) their keys,
    # which must be reported so -- else they sit in the store counted against no
    # capacity (stay accounted though gone); only the hung node's keys fail, counted.
    hung = own_cluster.nodes[1]
    adapter = _open_on_cluster(open_adapter, own_cluster, prefix, request_timeout=0.3, connection_timeout=0.3)
    old, new = make_keys(16)[:8], make_keys(16)[8:]
    store(adapter, old, size=16)
    on_hung = _on_node(adapter, own_cluster, hung, old + new)
    old_on_hung, new_on_hung = on_hung[:8], on_hung[8:]
    assert any(old_on_hung) and not all(old_on_hung) and any(new_on_hung) and not all(new_on_hung)
    hung.pause()
    try:
        buffers = [memoryview(bytearray(pattern(index, 16))) for index in range(len(new))]
        stored = BlockingAdapterClient(adapter, timeout=120).store(new, buffers)
    finally:
        hung.resume()
    # A timed-out connection is dropped, and a node that cannot be connected to fails
    # the trip before anything is sent: reconnect before the node hangs again.
    client_of(adapter).lookup_and_lock(old)
    adapter.unlock(old)
    hung.pause()
    try:
        deleted = adapter.delete(old)
    finally:
        hung.resume()
    assert stored == [not on for on in new_on_hung]
    assert deleted == [not on for on in old_on_hung]
    assert adapter.used_bytes() == 16 * (stored.count(True) + deleted.count(False))
    stats = adapter.stats()
    assert stats["store_request_failures"] == new_on_hung.count(True)
    assert stats["delete_request_failures"] == old_on_hung.count(True)
    # Each call failed part-way: reported with its answer, counted as failed.
    assert stats["circuit_failures"] >= 2 and stats["backend_errors"] >= 2


def test_a_test_cluster_node_paused_for_seconds_is_not_declared_failed(
    own_cluster: RedisClusterNodes,
) -> None:
    # The tests pause a node to see its keys alone fail.  A node the others declare
    # failed (no replica replaces it) makes every node answer CLUSTERDOWN, for every key:
    # the pause of a test on a loaded machine must not reach the cluster's node timeout.
    # A node is suspected only once it has not answered for a whole node timeout: with
    # the old 2 s, the others declared a paused one failed 2.7-3.9 s into its pause, on a
    # machine loaded past its cores.  A minute is far past any pause of these tests.
    paused = own_cluster.nodes[1]
    timeouts = [
        int(node.cli("CONFIG", "GET", "cluster-node-timeout").stdout.split()[1]) for node in own_cluster.nodes
    ]
    assert all(timeout >= 60_000 for timeout in timeouts), timeouts
    paused.pause()
    try:
        states = [node.cli("CLUSTER", "INFO").stdout for node in (own_cluster.nodes[0], own_cluster.nodes[2])]
    finally:
        paused.resume()
    assert all("cluster_state:ok" in state for state in states), states


def on_and_off_node(
    backend: RedisBackend, node: RedisServer, each: int, start: int = 0
) -> tuple[list[ObjectKey], list[bool]]:
    """``each`` keys served by ``node`` and ``each`` served by the other nodes, mixed, with
    whether each is on ``node``."""
    on: list[ObjectKey] = []
    off: list[ObjectKey] = []
    client = backend.client
    assert isinstance(client, redis.RedisCluster)
    for key in make_keys(64 * each, start=start):
        served = client.get_node_from_key(backend.name_of(key)).port == node.port
        (on if served else off).append(key)
    keys = [key for pair in zip(on[:each], off[:each], strict=True) for key in pair]
    return keys, [key in on for key in keys]


def test_a_cluster_node_that_answers_no_write_opens_the_circuit_through_stores_alone(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A node that takes connections and reads but answers no write (paused, stuck,
    # overloaded): each store batch it shares with the other nodes stores theirs and fails
    # its own keys -- a call failed part-way, which the circuit breaker must see, or a
    # store-only workload pays the timeout on every batch for good.
    paused = own_cluster.nodes[1]
    adapter = open_adapter(
        startup_nodes=own_cluster.startup_nodes,
        cluster_mode=True,
        key_prefix=prefix,
        request_timeout=0.3,
        connection_timeout=0.3,
        max_capacity_gb=1.0,
        circuit={"failure_threshold": 2, "probe_interval_s": 60},
    )
    backend = backend_of(adapter)
    first, first_on = on_and_off_node(backend, paused, 2, start=10_000)
    second, second_on = on_and_off_node(backend, paused, 2, start=20_000)
    third, _ = on_and_off_node(backend, paused, 2, start=30_000)
    buffers = [memoryview(bytearray(pattern(index, 16))) for index in range(len(first))]
    client = BlockingAdapterClient(adapter, timeout=120)
    paused.cli("CLIENT", "PAUSE", "60000", "WRITE")
    try:
        assert client.store(first, buffers) == [not on for on in first_on], "the other nodes' keys"
        assert client.store(second, buffers) == [not on for on in second_on]
        stats = adapter.stats()
        assert stats["backend_errors"] == 2 and stats["circuit_failures"] == 2
        assert stats["circuit_open"] == 1
        assert client.store(third, buffers) == [False] * 4, "refused while open"
        assert adapter.stats()["circuit_skipped_store_keys"] == 4
    finally:
        paused.cli("CLIENT", "UNPAUSE")
    assert adapter.used_bytes() == 16 * (first_on.count(False) + second_on.count(False))


def test_the_circuit_probe_of_a_cluster_asks_every_primary(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A cluster's PING goes to one node only: a probe asking it closes the circuit while
    # another primary still answers nothing, and every lookup pays the timeout again.
    adapter = open_adapter(
        startup_nodes=own_cluster.startup_nodes,
        cluster_mode=True,
        key_prefix=prefix,
        request_timeout=0.3,
        connection_timeout=0.3,
        circuit={"failure_threshold": 1, "probe_interval_s": 0.05},
    )
    backend = backend_of(adapter)
    client = backend.client
    assert isinstance(client, redis.RedisCluster)
    default = client.get_default_node().port
    hung = next(node for node in own_cluster.nodes if node.port != default)
    keys, _ = on_and_off_node(backend, hung, 2)
    # Stopped, the node answers nothing until it is resumed -- once a probe was seen --
    # and no pause of a test reaches the cluster's node timeout: no failover.
    hung.pause()
    try:
        assert client_of(adapter).lookup_and_lock(keys).found == [False] * 4
        assert adapter.stats()["circuit_open"] == 1
        wait_for(
            lambda: (
                adapter.stats().get("circuit_probe_failures", 0) + adapter.stats().get("circuit_closed", 0)
                > 0
            ),
            "a probe",
        )
        stats = adapter.stats()
        assert stats["circuit_open"] == 1 and stats.get("circuit_closed", 0) == 0, "closed while a node hangs"
    finally:
        hung.resume()
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close once the node answers")


def test_trips_bound_bytes_and_keys() -> None:
    assert [list(r) for r in trips([4, 4, 4, 10, 1], 8)] == [[0, 1], [2], [3], [4]]
    assert [len(r) for r in trips([0] * 1100, 1)] == [512, 512, 76]
    assert list(trips([], 8)) == []


def test_glob_characters_of_the_prefix_are_literal() -> None:
    assert glob_escape("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"


# -- the store going away and coming back -----------------------------------------------------


def test_a_hung_store_opens_the_circuit_and_it_closes_when_the_store_answers(
    tmp_path: Path, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        adapter = open_adapter(**quick_failing(server, prefix, failure_threshold=2))
        keys = make_keys(2)
        data = store(adapter, keys)
        server.pause()
        for _ in range(2):
            started = time.monotonic()
            assert client_of(adapter).lookup_and_lock(keys).found == [False, False]
            assert time.monotonic() - started < WAIT_S
        stats = adapter.stats()
        assert stats["circuit_open"] == 1 and stats["backend_errors"] == 2
        assert client_of(adapter).store(make_keys(1, start=9), [memoryview(bytearray(8))]) == [False]
        assert adapter.stats()["circuit_skipped_store_keys"] == 1
        server.resume()
        wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
        found = client_of(adapter).lookup_and_lock(keys)
        assert found.found == [True, True], "the paused store kept its objects"
        assert load(adapter, keys, found.sizes) == ([True, True], data)
        adapter.unlock(keys)
    finally:
        server.stop()


def test_an_adapter_opened_while_the_store_is_down_heals_when_it_starts(
    tmp_path: Path, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    if missing_reason():
        pytest.skip(missing_reason())
    server = RedisServer(tmp_path / "redis")
    adapter = open_adapter(
        url=server.url, key_prefix=prefix, circuit={"failure_threshold": 1, "probe_interval_s": 0.05}
    )
    keys = make_keys(1)
    assert client_of(adapter).lookup_and_lock(keys).found == [False]
    assert adapter.stats()["circuit_open"] == 1
    server.start()
    try:
        wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close")
        store(adapter, keys)
        assert client_of(adapter).lookup_and_lock(keys).found == [True]
        adapter.unlock(keys)
    finally:
        server.stop()


# -- credentials, transports, configuration ---------------------------------------------------


def test_a_cluster_url_with_credentials_reaches_every_node(
    redis_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    password = "cluster-" + SECRET
    with cluster_password(redis_cluster, password):
        caplog.set_level(logging.DEBUG)
        node = redis_cluster.nodes[0]
        adapter = open_adapter(
            url=f"redis://:{password}@{node.address}/0", cluster_mode=True, key_prefix=prefix
        )
        keys = make_keys(6)  # over several slots, so over several nodes
        data = store(adapter, keys)
        found = client_of(adapter).lookup_and_lock(keys)
        assert load(adapter, keys, found.sizes) == ([True] * 6, data)
        adapter.unlock(keys)
        assert password not in caplog.text


@contextlib.contextmanager
def cluster_password(cluster: RedisClusterNodes, password: str) -> Iterator[None]:
    """Every node of the shared ``cluster`` asks new connections for ``password`` (its
    default user's, as ``--requirepass`` sets it), and asks none again afterwards -- each
    node cleared whatever failed, a set half done or another node's clearing: a password
    left on one would fail every later test on the shared cluster."""
    try:
        for node in cluster.nodes:
            node.cli("CONFIG", "SET", "requirepass", password)
        for node in cluster.nodes:  # none answers a connection without it
            assert "NOAUTH" in node.cli("PING", check=False).stdout
        yield
    finally:
        with contextlib.ExitStack() as clearing:  # each node's clearing runs, errors raised after
            for node in cluster.nodes:
                clearing.callback(clear_password, node, password)


def clear_password(node: RedisServer, password: str) -> None:
    """``node`` asks new connections for no password (a node whose password was not
    set takes the AUTH all the same: its default user has none)."""
    with redis.Redis(host="127.0.0.1", port=node.port, password=password) as raw:
        raw.config_set("requirepass", "")


SECRET = "s3cr3t-" + uuid.uuid4().hex[:8]


@pytest.fixture
def protected_server(tmp_path: Path) -> Iterator[RedisServer]:
    if missing_reason():
        pytest.skip(missing_reason())
    server = RedisServer(
        tmp_path / "redis", password=SECRET, extra=["--unixsocket", str(tmp_path / "r.sock")]
    ).start()
    yield server
    server.stop()


@pytest.mark.parametrize("how", ["field", "url", "environment"])
def test_credentials_reach_the_store_and_never_the_log(
    protected_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    fields: dict[str, Any] = {"key_prefix": prefix, "url": protected_server.url}
    if how == "field":
        fields["password"] = SECRET
    elif how == "url":
        fields["url"] = f"redis://:{SECRET}@127.0.0.1:{protected_server.port}/0"
    else:
        monkeypatch.setenv("LMCACHE_RESP_PASSWORD", SECRET)
    adapter = open_adapter(**fields)
    keys = make_keys(1)
    store(adapter, keys)
    assert client_of(adapter).lookup_and_lock(keys).found == [True]
    adapter.unlock(keys)
    assert SECRET not in caplog.text


def test_a_wrong_password_is_refused_at_start_up_and_is_not_logged(
    protected_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError, match="refused the credentials") as refused:
        open_adapter(url=protected_server.url, key_prefix=prefix, password="wrong-" + SECRET)
    assert SECRET not in caplog.text + str(refused.value)


def test_a_unix_socket_url(
    protected_server: RedisServer, tmp_path: Path, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(url=f"unix://{tmp_path / 'r.sock'}?db=0", password=SECRET, key_prefix=prefix)
    keys = make_keys(2)
    data = store(adapter, keys)
    found = client_of(adapter).lookup_and_lock(keys)
    assert load(adapter, keys, found.sizes) == ([True, True], data)
    adapter.unlock(keys)


def test_print_config_and_plugins_show_never_print_credentials(tmp_path: Path) -> None:
    adapter = {"type": "redis", "url": f"redis://user:{SECRET}@127.0.0.1:1/0", "password": SECRET}
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_tiers.cli.main",
            "serve",
            "--print-config",
            "--l2-adapter",
            json.dumps(adapter),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMCACHE_TIERS_DISABLE_PLUGINS": ""},
    )
    assert printed.returncode == 0, printed.stderr
    shown = json.loads(printed.stdout)["l2_adapters"][0]
    assert shown["password"] == "***" and shown["url"] == "redis://user:***@127.0.0.1:1/0"
    assert SECRET not in printed.stdout + printed.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", "plugins", "show", "redis"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and "password" in listed.stdout


def test_lmcache_resp_and_valkey_json_is_accepted() -> None:
    registry = load_registry()
    resp = decode_adapter(registry, {"type": "resp", "host": "10.0.0.5", "port": 6380, "num_workers": 4}, 0)
    assert resp.config.seed_nodes() == [("10.0.0.5", 6380)] and resp.config.num_workers == 4
    valkey = decode_adapter(
        registry,
        {
            "type": "valkey",
            "startup_nodes": "h1:7000,h2:7001",
            "cluster_mode": True,
            "key_prefix": "team-a",
            "request_timeout": 2.0,
            "connection_timeout": 3.0,
            "max_capacity_gb": 10,
            "tls_enable": False,
        },
        1,
    )
    assert valkey.config.seed_nodes() == [("h1", 7000), ("h2", 7001)]
    with pytest.raises(ConfigError, match=r"ttl_seconds.*\$\.l2_adapters\[0\]"):
        decode_adapter(registry, {"type": "valkey", "startup_nodes": "h:1", "ttl_seconds": 60}, 0)


@pytest.mark.parametrize(
    ("fields", "path", "message"),
    [
        ({}, "url", "set one of url"),
        ({"url": "http://h:1"}, "url", "scheme"),
        ({"url": "unix://"}, "url", "socket path"),
        ({"url": "redis://h:1", "host": "h"}, "host", "only one"),
        ({"host": "h", "port": 0}, "port", ""),
        ({"startup_nodes": "h1:x"}, "startup_nodes", "host:port"),
        ({"startup_nodes": "h1:6379,h2:70000", "cluster_mode": True}, "startup_nodes", "1 to 65535"),
        ({"url": "redis://:secret@h:99999/0"}, "url", "port must be a number from 1 to 65535"),
        ({"url": "rediss://h:0"}, "url", "port must be a number from 1 to 65535"),
        ({"url": "redis://u:secret@h:port/0", "cluster_mode": True}, "url", "port must be"),
        ({"url": "unix:///s.sock", "cluster_mode": True}, "url", "TCP"),
        ({"startup_nodes": "h:1", "cluster_mode": True, "key_prefix": "{a}"}, "key_prefix", "hash tag"),
        ({"url": "redis://h:1", "key_prefix": "a b"}, "key_prefix", "spaces"),
        ({"url": "redis://h:1", "request_timeout": 0}, "request_timeout", ""),
        ({"url": "redis://h:1/2", "database_id": 3}, "database_id", "contradicts database 2 of the url"),
        ({"url": "unix:///s.sock?db=2", "database_id": 0}, "database_id", "contradicts database 2"),
        ({"url": "redis://h:1/1", "cluster_mode": True}, "url", "database 0 only"),
        ({"url": "redis://:secret@h:1/0", "password": "other"}, "password", "contradicts the password"),
        ({"url": "redis://u:secret@h:1/0", "username": "v"}, "username", "contradicts the username"),
        ({"url": "unix:///s.sock", "tls_enable": True}, "tls_enable", "unix"),
        ({"url": "redis://:secret@h:1/0?decode_responses=false"}, "url", "decode_responses"),
    ],
)
def test_bad_config_is_refused_naming_the_field(fields: dict[str, Any], path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"{message}.*\$\.l2_adapters\[2\]\.{path}") as refused:
        decode_adapter(load_registry(), {"type": "redis", **fields}, 2)
    assert "Traceback" not in str(refused.value) and "secret" not in str(refused.value)


def test_fields_that_agree_with_the_url_are_accepted() -> None:
    config = msgspec.convert(
        {"url": "redis://u:pw@h:1/2", "username": "u", "password": "pw", "database_id": 2}, RedisConfig
    )
    assert config.database_id == 2


def test_the_repr_of_a_config_never_shows_a_password() -> None:
    config = RedisConfig(url=f"redis://user:{SECRET}@h:1/0", password=SECRET)
    assert SECRET not in repr(config) and SECRET not in str(config)
    assert "redis://user:***@h:1/0" in repr(config)
    # redis-py also reads the password from the query string
    config = RedisConfig(url=f"redis://h:1/0?password={SECRET}&db=0")
    assert SECRET not in repr(config) and "redis://h:1/0?password=***&db=0" in repr(config)


def test_config_is_frozen_and_strict() -> None:
    config = msgspec.convert({"url": "redis://h:1"}, RedisConfig)
    with pytest.raises(AttributeError):
        config.url = "redis://x"  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"url": "redis://h:1", "nonsense": 1}, RedisConfig)


@pytest.mark.parametrize("cluster_path", [False, True], ids=["direct", "pipelined"])
def test_a_payload_of_the_buffer_size_but_not_the_header_size_is_never_written_to_the_buffer(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter], cluster_path: bool
) -> None:
    # The header says 4096 bytes, the payload holds 2048, and the load buffer is 2048 (a
    # caller sized it so): the record is damage, known from its header before a byte of
    # its payload reaches the caller's buffer -- which must stay as it was.
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    backend = backend_of(adapter)
    if cluster_path:  # the replies redis-py parses, as in cluster mode
        backend._direct = None
    keys = make_keys(1)
    data = store(adapter, keys, size=4096)
    raw = redis.Redis.from_url(redis_server.url)
    name = backend.name_of(keys[0])
    set_payload(raw, name, data[0][:2048])
    buffer = memoryview(bytearray(b"\xaa" * 2048))
    assert backend.get_many_into(keys, [buffer]) == [False]
    assert bytes(buffer) == b"\xaa" * 2048, "bytes of a record failing its header were written"
    assert raw.exists(name) == 0, "damage is removed"
    assert adapter.stats()["corrupt_records_removed"] == 1


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_delete_leaves_the_record_of_another_key_that_replaced_its_object(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # One prefix extends the other, so key "m..." of one server and key "xm..." of the
    # other share a name.  Once the other server replaced this server's object there, an
    # eviction here must not remove that server's acknowledged object.
    where, raw = shared_store(request, mode)
    writer = open_adapter(**where, key_prefix=prefix)
    evicting = open_adapter(**where, key_prefix=prefix + "x", max_capacity_gb=1.0)
    theirs = ObjectKey("xmodel", 0, b"\x07" * 32)
    mine = ObjectKey("model", 0, b"\x07" * 32)
    name = backend_of(writer).name_of(theirs)
    store(evicting, [mine])
    data = store(writer, [theirs], seed=5)
    header = header_of(raw, name)
    assert evicting.delete([mine]) == [False]
    assert header_of(raw, name) == header, "the other server's object was deleted"
    assert evicting.used_bytes() == 0, "the key is gone from here: its bytes are released"
    assert evicting.stats()["foreign_records"] == 1, "counted once, by the delete"
    found = client_of(writer).lookup_and_lock([theirs])
    assert load(writer, [theirs], found.sizes) == ([True], data)
    writer.unlock([theirs])


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_records_of_another_serde_chain_are_listed_counted_and_evictable(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # The chain was changed between restarts: the old chain's records are misses, kept,
    # yet they hold memory in Redis -- the start-up listing must count them against the
    # capacity, or nothing ever evicts them.
    where, raw = shared_store(request, mode)
    namer = backend_of(open_adapter(**where, key_prefix=prefix))
    keys = make_keys(3)
    sizes = [4096, 5000, 70000]
    for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
        payload = pattern(index, size)
        header = encode_header(key, payload, serde=("zstd",))
        put_record(raw, namer.name_of(key), header, payload)
    adapter = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    assert adapter.used_bytes() == sum(sizes), "the old chain's records are not counted"
    assert client_of(adapter).lookup_and_lock(keys).found == [False] * 3, "another chain's record is a miss"
    assert [raw.exists(namer.name_of(key)) for key in keys] == [1, 1, 1], "and it is kept"
    assert adapter.used_bytes() == sum(sizes), "a kept miss is not absent: its bytes stay counted"
    assert adapter.stats()["serde_chain_mismatch"] >= 3
    # The eviction's delete removes them.
    assert adapter.delete(keys) == [True] * 3
    assert [raw.exists(namer.name_of(key)) for key in keys] == [0, 0, 0]
    assert adapter.used_bytes() == 0


def test_records_of_another_serde_chain_over_the_capacity_are_evicted(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # 16 records of the old chain, 200 KiB each, under a 1 MiB cap: an LRU eviction
    # controller deletes them until the usage is below its watermark.
    raw = redis.Redis.from_url(redis_server.url)
    namer = backend_of(open_adapter(url=redis_server.url, key_prefix=prefix))
    keys = make_keys(16)
    payload = pattern(1, 200 << 10)
    for key in keys:
        header = encode_header(key, payload, serde=("zstd",))
        put_record(raw, namer.name_of(key), header, payload)
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix, max_capacity_gb=1 / 1024)
    wait_for(lambda: not adapter.stats()["scan_running"], "the start-up scan")
    assert adapter.usage() > 3.0, adapter.stats()
    controller = _eviction_controller(adapter, L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.5))
    controller.step(set())  # type: ignore[attr-defined]
    assert adapter.usage() < 0.8
    assert sum(raw.exists(namer.name_of(key)) for key in keys) * (200 << 10) == adapter.used_bytes()


def _nodes_of(request: pytest.FixtureRequest, mode: str) -> list[RedisServer]:
    """The servers of ``shared_store``'s store: each keeps its own ACL."""
    if mode == "standalone":
        return [request.getfixturevalue("redis_server")]
    return list(request.getfixturevalue("redis_cluster").nodes)


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_user_denied_strlen_opens_and_leaves_other_chain_records_unlisted_counted(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    # An ACL granting the adapter's commands one by one, all but the optional STRLEN:
    # the adapter still opens (sizing another chain's records is no reason to refuse a
    # running deployment); those records are left out of the listing as before, counted,
    # and one warning names the grant.
    where, raw = shared_store(request, mode)
    user = f"no-strlen-{uuid.uuid4().hex[:8]}"
    # every command the adapter needs but STRLEN, and the permission check's transaction
    granted = ["+ping", "+set", "+get", "+getrange", "+scan", "+evalsha", "+eval", "+unlink"]
    granted += ["+multi", "+discard"]
    client_side = (
        ["+cluster|slots", "+cluster|shards", "+cluster|nodes", "+command"] if mode == "cluster" else []
    )
    nodes = _nodes_of(request, mode)
    for node in nodes:
        node.cli(
            "ACL", "SETUSER", user, "reset", "on", ">pw", f"~{glob_escape(prefix)}*", *granted, *client_side
        )
    try:
        namer = backend_of(open_adapter(**where, key_prefix=prefix))
        keys = make_keys(3)
        for index, key in enumerate(keys):
            payload = pattern(index, 4096)
            header = encode_header(key, payload, serde=("zstd",))
            put_record(raw, namer.name_of(key), header, payload)
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
            adapter = open_adapter(
                **where, key_prefix=prefix, username=user, password="pw", max_capacity_gb=1.0
            )
            assert adapter.used_bytes() == 0, "unsized records are left out of the usage"
        assert adapter.stats()["listing_foreign_unsized"] == 3
        assert adapter.stats().get("listing_reply_errors", 0) == 0, "a denied STRLEN is no reply error"
        warnings = [r.getMessage() for r in caplog.records if "STRLEN" in r.getMessage()]
        assert len(warnings) == 1 and "+strlen" in warnings[0], warnings
        assert [raw.exists(namer.name_of(key)) for key in keys] == [1, 1, 1], "they are kept"
        mine = make_keys(2, start=10)
        data = store(adapter, mine)
        # Lookups believe the header where its payload's length cannot be read: counted.
        found = client_of(adapter).lookup_and_lock(mine)
        assert found.found == [True, True], "lookups work without STRLEN"
        assert adapter.stats()["payload_length_unchecked"] == 2
        assert load(adapter, mine, found.sizes) == ([True, True], data), "the adapter works without STRLEN"
        adapter.unlock(mine)
    finally:
        for node in nodes:
            node.cli("ACL", "DELUSER", user)


def test_a_delete_leaves_a_record_of_a_newer_format_and_removes_the_others(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A newer server sharing the store replaced one object with its own format: it reads
    # it, so a delete here keeps it; this server's own record of the other key goes.
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    keys = make_keys(2)
    store(adapter, keys)
    raw = redis.Redis.from_url(redis_server.url)
    names = [backend_of(adapter).name_of(key) for key in keys]
    header = bytearray(header_of(raw, names[0]))
    header[4:6] = (99).to_bytes(2, "little")
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")  # intact: a newer server's
    set_header(raw, names[0], bytes(header))
    assert adapter.delete(keys) == [False, True]
    assert header_of(raw, names[0]) == bytes(header) and raw.exists(names[1]) == 0
    stats = adapter.stats()
    assert stats["record_version_unknown"] == 1 and stats.get("corrupt_records_removed", 0) == 0
    assert adapter.used_bytes() == 0


def test_a_delete_whose_later_removals_fail_counts_only_the_keys_it_could_not_remove(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The connection drops before the second trip's removals (its headers were read): of
    # that trip, the newer format's record was judged and kept (counted as such), so only
    # the other key failed for the store's sake.
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    keys = make_keys(KEYS_PER_TRIP + 2)
    store(adapter, keys, size=16)
    backend = backend_of(adapter)
    raw = redis.Redis.from_url(own_server.url)
    header = bytearray(header_of(raw, backend.name_of(keys[-1])))
    header[4:6] = (99).to_bytes(2, "little")
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")  # intact: a newer server's
    set_header(raw, backend.name_of(keys[-1]), bytes(header))
    # trip one's reads and removals, trip two's reads, then its removals fail
    cache_the_removal_script(backend)
    fail_pipeline(backend, 4, redis.ConnectionError("Connection closed by server."))
    assert adapter.delete(keys) == [True] * KEYS_PER_TRIP + [False, False]
    stats = adapter.stats()
    assert stats["delete_request_failures"] == 1, "a kept record was counted as a failed request"
    assert stats["record_version_unknown"] == 1
    assert raw.exists(backend.name_of(keys[-2])) == 1 and adapter.used_bytes() == 16


def refuse_writes_from_pipeline(backend: Any, number: int, server: RedisServer) -> None:
    """Have ``server`` refuse every write (NOREPLICAS) from the ``number``-th pipeline
    ``backend`` executes from now on: the earlier ones run against a writable store."""
    execute, calls = backend._execute, []

    def refusing_from_then(pipe: Any, **options: Any) -> list[Any]:
        calls.append(pipe)
        if len(calls) == number:
            _refuse_writes_for_want_of_replicas(server)
        return execute(pipe, **options)

    backend._execute = refusing_from_then


def test_a_delete_whose_later_removals_the_store_refuses_counts_them_as_refused(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The store refuses every write from trip two's removals on (min-replicas-to-write
    # unmet): its keys were answered -- refused -- not lost on the way, and are counted
    # as the store's refusal, never as failed requests.
    adapter, backend, keys = stored_for_a_two_trip_delete(own_server, prefix, open_adapter)
    refuse_writes_from_pipeline(backend, 4, own_server)  # trip two's removals
    assert adapter.delete(keys) == [True] * KEYS_PER_TRIP + [False, False]
    stats = adapter.stats()
    assert stats.get("delete_request_failures", 0) == 0, "refused keys counted as failed requests"
    assert stats["delete_refused_by_server"] == 2
    assert stats["backend_errors"] == 1, "the refusal reaches the circuit breaker"
    assert adapter.used_bytes() == 2 * 16


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_delete_that_finds_something_else_under_the_name_counts_it_once(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # Something else (a hash, not a record's string) replaced this server's object under
    # its name: the eviction's delete leaves it, counted, and the lookup core makes right
    # after the delete to see whether the key is still there finds it again.
    where, raw = shared_store(request, mode)
    adapter = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    key = make_keys(1)[0]
    store(adapter, [key], size=16)
    name = backend_of(adapter).name_of(key)
    raw.delete(name)
    raw.hset(name, "field", b"somebody else's hash")
    assert adapter.delete([key]) == [False]
    assert raw.hget(name, "field") == b"somebody else's hash", "what another party wrote was deleted"
    assert adapter.used_bytes() == 0, "the key is gone from here: its bytes are released"
    assert adapter.stats()["foreign_objects"] == 1, "counted once, by the delete"
    assert client_of(adapter).lookup_and_lock([key]).found == [False]
    assert adapter.stats()["foreign_objects"] == 2, "a later lookup counts what it finds"


def each_fails_as_a_whole(adapter: BackendAdapter, calls: list[Callable[[], list[bool]]]) -> None:
    """Each call of a store refusing every command of its kind fails as a call -- core
    counts it and the circuit sees it -- and no refusal of a single object is counted."""
    for call in calls:
        assert not any(call())
    stats = adapter.stats()
    refusals = {name: count for name, count in stats.items() if name.endswith("_reply_errors") and count}
    assert refusals == {}, "counted as refusals about single objects"
    assert stats["backend_errors"] == len(calls) and stats["circuit_failures"] == len(calls)


def _two_stored_with_a_patient_circuit(
    server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> tuple[BackendAdapter, list[ObjectKey]]:
    """An adapter holding two objects, its removal script cached before the store turns
    refusing, and a circuit that stays closed through the failures a test counts."""
    adapter = open_adapter(
        url=server.url, key_prefix=prefix, max_capacity_gb=1.0, circuit={"failure_threshold": 100}
    )
    keys = make_keys(2)
    store(adapter, keys, size=16)
    cache_the_removal_script(backend_of(adapter))
    return adapter, keys


@pytest.mark.parametrize("stale_reads", ["yes", "no"], ids=["readonly", "masterdown"])
def test_a_store_that_refuses_every_command_fails_the_calls_for_the_circuit(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter], stale_reads: str
) -> None:
    # A primary turned replica (a failover, a misdirected url) answers READONLY to every
    # write, and with its primary gone and stale reads off, MASTERDOWN to every read: the
    # store refuses, not one object.  Each call fails -- core counts it and the circuit
    # sees it -- rather than a reply error per key that no breaker ever hears about.
    adapter, keys = _two_stored_with_a_patient_circuit(own_server, prefix, open_adapter)
    found = client_of(adapter).lookup_and_lock(keys)
    adapter.unlock(keys)
    own_server.cli("CONFIG", "SET", "replica-serve-stale-data", stale_reads)
    own_server.cli("REPLICAOF", "127.0.0.1", "1")  # a primary nobody answers on
    try:
        calls = [
            lambda: client_of(adapter).store(make_keys(2, start=100), [memoryview(bytearray(16))] * 2),
            lambda: adapter.delete(keys),
        ]
        if stale_reads == "no":
            calls.append(lambda: load(adapter, keys, found.sizes)[0])
        each_fails_as_a_whole(adapter, calls)
        assert adapter.used_bytes() == 2 * 16
    finally:
        own_server.cli("REPLICAOF", "NO", "ONE")


def test_a_damaged_record_is_removed_while_a_cluster_node_it_is_not_on_is_down(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The removal goes to the record's node alone, by digest, and its body only to that
    # node when it lost the script: another primary being down does not matter.
    adapter = open_adapter(startup_nodes=own_cluster.startup_nodes, cluster_mode=True, key_prefix=prefix)
    backend = backend_of(adapter)
    keys = make_keys(1)
    data = store(adapter, keys)
    name = backend.name_of(keys[0])
    holder = backend.client.get_node_from_key(name)
    down = next(node for node in own_cluster.nodes if node.port != holder.port)
    for node in own_cluster.nodes:
        node.cli("SCRIPT", "FLUSH")
    raw = redis.Redis(host="127.0.0.1", port=holder.port)
    _flip_a_payload_byte(raw, name, data[0])
    down.stop()
    assert load(adapter, keys, [4096])[0] == [False]
    stats = adapter.stats()
    assert stats["corrupt_records_removed"] == 1
    assert stats.get("corrupt_remove_failures", 0) == 0
    assert raw.exists(name) == 0


def test_a_full_store_refuses_stores_counted_as_refused_and_still_serves(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # redis-py parses a pipelined OOM into OutOfMemoryError and drops "OOM" from its
    # text: a full store's refusal is still counted as such, not as a reply error, and
    # it fails the stores alone (lookups and deletes, which free the store, go on).
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, max_capacity_gb=1.0)
    kept = make_keys(2)
    store(adapter, kept, size=16)
    own_server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    own_server.cli("CONFIG", "SET", "maxmemory", "1")
    try:
        refused = make_keys(2, start=100)
        assert client_of(adapter).store(refused, [memoryview(bytearray(16))] * 2) == [False, False]
        stats = adapter.stats()
        assert stats.get("store_refused_by_server", 0) == 2
        assert stats.get("store_reply_errors", 0) == 0, "counted as an error reply about the object"
        assert stats.get("backend_errors", 0) == 0, "a full store is no failed call"
        assert client_of(adapter).lookup_and_lock(kept).found == [True, True]
        adapter.unlock(kept)
        assert adapter.delete(kept) == [True, True]
    finally:
        own_server.cli("CONFIG", "SET", "maxmemory", "0")


def _refuse_writes_for_want_of_replicas(server: RedisServer) -> None:
    server.cli("CONFIG", "SET", "min-replicas-to-write", "1")  # and it has none


def _refuse_writes_after_a_failed_snapshot(server: RedisServer) -> None:
    server.cli("CONFIG", "SET", "save", "3600 1")
    shutil.rmtree(server.directory)  # the snapshot cannot be written
    server.cli("BGSAVE")
    wait_for(
        lambda: "rdb_last_bgsave_status:err" in server.cli("INFO", "persistence").stdout,
        "the snapshot to fail",
    )


@pytest.mark.parametrize(
    "refuse_writes",
    [_refuse_writes_for_want_of_replicas, _refuse_writes_after_a_failed_snapshot],
    ids=["noreplicas", "misconf"],
)
def test_a_store_that_refuses_every_write_fails_the_calls_for_the_circuit(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    refuse_writes: Callable[[RedisServer], None],
) -> None:
    # NOREPLICAS (min-replicas-to-write unmet) and MISCONF (a failed snapshot) refuse
    # every write, whatever the key: a store and a delete fail as calls, which core
    # counts and the circuit breaker sees, not as refusals of single objects.
    adapter, keys = _two_stored_with_a_patient_circuit(own_server, prefix, open_adapter)
    refuse_writes(own_server)
    calls = [
        lambda: client_of(adapter).store(make_keys(2, start=100), [memoryview(bytearray(16))] * 2),
        lambda: adapter.delete(keys),
    ]
    each_fails_as_a_whole(adapter, calls)
    assert adapter.used_bytes() == 2 * 16


def test_a_cluster_batch_one_node_of_which_refuses_writes_counts_its_keys_as_refused(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # One trip reaches every node: a node refusing every write (min-replicas-to-write
    # unmet) answered its keys -- refused -- while the others stored theirs; its keys are
    # the store's refusal, counted as such, never as requests lost on the way.
    refusing = own_cluster.nodes[1]
    adapter = _open_on_cluster(open_adapter, own_cluster, prefix)
    keys = make_keys(16)
    on_refusing = _on_node(adapter, own_cluster, refusing, keys)
    assert any(on_refusing) and not all(on_refusing)
    _refuse_writes_for_want_of_replicas(refusing)
    buffers = [memoryview(bytearray(pattern(index, 16))) for index in range(len(keys))]
    stored = BlockingAdapterClient(adapter, timeout=120).store(keys, buffers)
    assert stored == [not on for on in on_refusing]
    stats = adapter.stats()
    assert stats.get("store_request_failures", 0) == 0, "refused keys counted as failed requests"
    assert stats["store_refused_by_server"] == on_refusing.count(True)
    assert stats["backend_errors"] >= 1, "the refusal reaches the circuit breaker"


@pytest.mark.parametrize(
    ("rules", "named"),
    [
        (["~*", "+@all", "-set"], "SET: .*'set' command"),
        (["~*", "+@all", "-@scripting"], "EVALSHA: .*'evalsha' command.*EVAL: "),
        (["~*", "+@all", "-unlink"], "UNLINK: .*'unlink' command"),
        (["~elsewhere:*", "+@all"], "SET: .*keys"),
        (["~*", "+@all", "-ping"], "PING"),
    ],
    ids=["no-set", "no-scripts", "no-unlink", "other-keys", "no-ping"],
)
def test_a_user_the_acl_denies_a_needed_command_is_refused_at_start_up(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    rules: list[str],
    named: str,
) -> None:
    # Without the refusal the adapter would start and then fail every lookup, or refuse
    # every store or delete object by object, long after start-up.
    own_server.cli("ACL", "SETUSER", "limited", "reset", "on", ">limited-pw", *rules)
    with pytest.raises(ConfigError, match=named):
        open_adapter(url=own_server.url, key_prefix=prefix, username="limited", password="limited-pw")
    # The check ran nothing: no name was written under the prefix.
    assert redis.Redis.from_url(own_server.url).keys(glob_escape(prefix) + "*") == []


def test_a_user_allowed_the_needed_commands_on_its_prefix_opens(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    own_server.cli(
        "ACL",
        "SETUSER",
        "narrow",
        "reset",
        "on",
        ">narrow-pw",
        f"~{glob_escape(prefix)}*",
        "+ping",
        "+set",
        "+get",
        "+getrange",
        "+strlen",
        "+scan",
        "+evalsha",
        "+eval",
        "+unlink",
        "+multi",
        "+discard",
    )
    adapter = open_adapter(url=own_server.url, key_prefix=prefix, username="narrow", password="narrow-pw")
    keys = make_keys(2)
    data = store(adapter, keys)
    assert load(adapter, keys, [4096, 4096]) == ([True, True], data)
    assert adapter.delete(keys) == [True, True]


def test_a_replica_is_not_refused_at_start_up_by_the_permission_check(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A replica (a failover, a misdirected url) answers READONLY to SET queued in the
    # check's MULTI: that is no ACL denial, and the store heals through the circuit like
    # any replica, so the adapter opens -- the commands it could not check named in a warning.
    own_server.cli("REPLICAOF", "127.0.0.1", "1")  # a primary nobody answers on
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
            open_adapter(url=own_server.url, key_prefix=prefix)
    finally:
        own_server.cli("REPLICAOF", "NO", "ONE")
    assert any("SET: You can't write against a read only replica" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("denied_on", "rules", "named"),
    [
        ("every", ["~*", "+@all", "-unlink"], "UNLINK: .*'unlink' command"),
        ("every", ["~elsewhere:*", "+@all"], "SET: .*keys"),
        ("one", ["~*", "+@all", "-set"], "SET: .*'set' command"),
    ],
    ids=["no-unlink", "other-keys", "no-set-on-one-node"],
)
def test_a_cluster_user_the_acl_denies_a_needed_command_is_refused_at_start_up(
    redis_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    denied_on: str,
    rules: list[str],
    named: str,
) -> None:
    # Each cluster node keeps its own ACL: a user denied a command on one primary only
    # would fail every call on that primary's share of the keys, so every primary is asked.
    user = f"limited-{uuid.uuid4().hex[:8]}"
    full = ["~*", "+@all"]
    last = len(redis_cluster.nodes) - 1
    for number, node in enumerate(redis_cluster.nodes):
        node_rules = rules if denied_on == "every" or number == last else full
        node.cli("ACL", "SETUSER", user, "reset", "on", ">limited-pw", *node_rules)
    try:
        with pytest.raises(ConfigError, match=named) as refused:
            open_adapter(
                startup_nodes=redis_cluster.startup_nodes,
                cluster_mode=True,
                key_prefix=prefix,
                username=user,
                password="limited-pw",
            )
        assert redis_cluster.nodes[last].address in str(refused.value), "the denying node is named"
        # The check ran nothing: no name was written under the prefix on any node.
        raw = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
        assert raw.keys(glob_escape(prefix) + "*", target_nodes=redis.RedisCluster.PRIMARIES) == []
    finally:
        for node in redis_cluster.nodes:
            node.cli("ACL", "DELUSER", user)


def test_a_cluster_user_allowed_the_needed_commands_opens(
    redis_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    user = f"narrow-{uuid.uuid4().hex[:8]}"
    needed = ["+ping", "+set", "+get", "+getrange", "+strlen", "+scan", "+evalsha", "+eval", "+unlink"]
    # what redis-py's cluster client asks for the slot map, and the check's transaction
    client_side = ["+cluster|slots", "+cluster|shards", "+cluster|nodes", "+multi", "+discard", "+command"]
    for node in redis_cluster.nodes:
        node.cli("ACL", "SETUSER", user, "reset", "on", ">narrow-pw", f"~{glob_escape(prefix)}*", *needed)
        node.cli("ACL", "SETUSER", user, *client_side)
    try:
        adapter = open_adapter(
            startup_nodes=redis_cluster.startup_nodes,
            cluster_mode=True,
            key_prefix=prefix,
            username=user,
            password="narrow-pw",
        )
        keys = make_keys(6)
        data = store(adapter, keys)
        assert load(adapter, keys, [4096] * 6) == ([True] * 6, data)
        assert adapter.delete(keys) == [True] * 6
    finally:
        for node in redis_cluster.nodes:
            node.cli("ACL", "DELUSER", user)


def _user_denied_set_on(cluster: RedisClusterNodes, denying: RedisServer) -> str:
    """A new user (password ``limited-pw``) allowed everything on every node of
    ``cluster`` but SET on ``denying``: each node keeps its own ACL."""
    user = f"limited-{uuid.uuid4().hex[:8]}"
    for node in cluster.nodes:
        rules = ["~*", "+@all", "-set"] if node is denying else ["~*", "+@all"]
        node.cli("ACL", "SETUSER", user, "reset", "on", ">limited-pw", *rules)
    return user


def test_a_cluster_primary_that_does_not_answer_leaves_the_others_checked(
    own_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A cluster of its own: the shared one cannot lose a node.  One primary denies SET,
    # another is killed before open (still in every slot map): the denial found on the
    # live primary refuses the start, and the dead one is named as not checked.
    denying, dead = own_cluster.nodes[1], own_cluster.nodes[2]
    user = _user_denied_set_on(own_cluster, denying)
    dead.stop()
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(ConfigError, match=r"SET: .*'set' command") as refused,
    ):
        open_adapter(
            startup_nodes=own_cluster.nodes[0].address,
            cluster_mode=True,
            key_prefix=prefix,
            username=user,
            password="limited-pw",
        )
    assert denying.address in str(refused.value), "the denying node is named"
    unchecked = [r.getMessage() for r in caplog.records if "could not check" in r.getMessage()]
    assert any(dead.address in message for message in unchecked), unchecked


def test_a_cluster_primary_that_hung_at_start_up_is_checked_when_it_answers(
    own_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A primary that did not answer the start-up check was never checked again: once it
    # answered, the circuit stayed closed and every store of its share of the keys was
    # refused object by object.  Its first answer is checked now: the denial is counted,
    # the adapter's calls refused (the circuit opens and its probe keeps it open) until
    # the ACL allows the commands.
    denying = own_cluster.nodes[2]
    user = _user_denied_set_on(own_cluster, denying)
    denying.pause()  # hung: the check at open times out on it
    try:
        with caplog.at_level(logging.WARNING):
            adapter = open_adapter(
                startup_nodes=own_cluster.nodes[0].address,
                cluster_mode=True,
                key_prefix=prefix,
                username=user,
                password="limited-pw",
                request_timeout=0.3,
                connection_timeout=0.3,
                circuit={"failure_threshold": 1, "probe_interval_s": 0.05},
            )
    finally:
        denying.resume()
    assert "permissions_denied" not in adapter.stats()
    keys = make_keys(4)

    def denial_counted() -> bool:
        # A lookup checks the node (or the circuit's probe does, if start-up opened it).
        assert client_of(adapter).lookup_and_lock(keys).found == [False] * 4
        return adapter.stats().get("permissions_denied", 0) > 0

    wait_for(denial_counted, "the check of the primary once it answers")
    assert any(
        "SET" in r.getMessage() and denying.address in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR
    )
    wait_for(lambda: adapter.stats()["circuit_open"] == 1, "the circuit to open on the denial")
    probes = adapter.stats().get("circuit_probe_failures", 0)
    wait_for(lambda: adapter.stats().get("circuit_probe_failures", 0) > probes, "a probe")
    assert adapter.stats()["circuit_open"] == 1, "the probe closed the circuit on a denying node"
    # Allowed at last: the probe's check passes and calls resume.
    denying.cli("ACL", "SETUSER", user, "+set")
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close once allowed")
    data = store(adapter, keys)
    assert load(adapter, keys, [4096] * 4) == ([True] * 4, data)


def test_a_denying_cluster_primary_that_does_not_answer_a_later_check_keeps_its_denial(
    own_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # A check that got no verdict from the primary that denied (hung, or left out of the
    # calls' checks for its pause) says nothing of its ACL: the denial stands -- not
    # cleared for calls to go on, then counted and logged again as news once it answers.
    denying = own_cluster.nodes[2]
    user = _user_denied_set_on(own_cluster, denying)
    denying.pause()  # hung: the check at open times out on it, so the check is owed
    try:
        adapter = open_adapter(
            startup_nodes=own_cluster.nodes[0].address,
            cluster_mode=True,
            key_prefix=prefix,
            username=user,
            password="limited-pw",
            request_timeout=0.3,
            connection_timeout=0.3,
        )
    finally:
        denying.resume()
    backend = backend_of(adapter)
    backend._check_owed_permissions()
    assert backend._denied is not None and adapter.stats()["permissions_denied"] == 1
    denying.pause()
    try:
        backend._check_owed_permissions()  # the probe's check: no answer
        assert backend._denied is not None, "a check without the denying primary's verdict cleared it"
        backend._check_owed_permissions(pausing=True)  # a call's check: the primary is paused
        assert backend._denied is not None, "a check leaving the denying primary out cleared it"
    finally:
        denying.resume()
    backend._check_owed_permissions()
    assert backend._denied is not None
    assert adapter.stats()["permissions_denied"] == 1, "the standing denial was counted again"


@pytest.fixture
def brief_tls_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that does not answer at open is asked whether it speaks TLS only, which a
    hung one answers by waiting out the check's 2 s; the tests of what an adapter opened
    on a hung store does later need not sit that out (the check finds no TLS either way)."""
    monkeypatch.setattr(client_module, "_PLAIN_CHECK_S", 0.2)


def _opened_while_hung_denying_unlink(
    server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> BackendAdapter:
    """An adapter of user ``limited``, whom ``server``'s ACL denies UNLINK, opened while
    ``server`` hung: its start-up check got no verdict, so the check is owed."""
    server.cli("ACL", "SETUSER", "limited", "reset", "on", ">limited-pw", "~*", "+@all", "-unlink")
    server.pause()
    try:
        return open_adapter(**quick_failing(server, prefix, 1), username="limited", password="limited-pw")
    finally:
        server.resume()


@pytest.mark.usefixtures("brief_tls_checks")
def test_a_store_hung_at_start_up_is_checked_when_it_answers(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The same for a single store: one not answering at open was never checked at all.
    adapter = _opened_while_hung_denying_unlink(own_server, prefix, open_adapter)
    keys = make_keys(2)

    def denial_counted() -> bool:
        assert client_of(adapter).lookup_and_lock(keys).found == [False] * 2
        return adapter.stats().get("permissions_denied", 0) > 0

    wait_for(denial_counted, "the check of the store once it answers")
    wait_for(lambda: adapter.stats()["circuit_open"] == 1, "the circuit to open on the denial")
    # Each probe checks again and finds the same denial: it is counted and logged once,
    # not once per probe (20 a second here) or per call.
    probes = adapter.stats().get("circuit_probe_failures", 0)
    wait_for(lambda: adapter.stats().get("circuit_probe_failures", 0) > probes + 2, "more probes")
    assert client_of(adapter).lookup_and_lock(keys).found == [False] * 2
    assert adapter.stats()["permissions_denied"] == 1, adapter.stats()
    own_server.cli("ACL", "SETUSER", "limited", "+unlink")
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the circuit to close once allowed")
    data = store(adapter, keys)
    assert load(adapter, keys, [4096] * 2) == ([True] * 2, data)
    assert adapter.delete(keys) == [True] * 2


@pytest.mark.usefixtures("brief_tls_checks")
def test_a_store_hung_at_start_up_that_refuses_the_check_is_said_to_when_it_answers(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The check made once the store answers gets no verdict from a user denied MULTI; it
    # is not asked again, so the skipped check is said in a warning, as at start-up.
    own_server.cli("ACL", "SETUSER", "nomulti", "reset", "on", ">nomulti-pw", "~*", "+@all", "-multi")
    own_server.pause()
    try:
        adapter = open_adapter(
            **quick_failing(own_server, prefix, 1), username="nomulti", password="nomulti-pw"
        )
    finally:
        own_server.resume()
    keys = make_keys(2)

    def refusal_said() -> bool:
        with contextlib.suppress(Exception):
            client_of(adapter).lookup_and_lock(keys)
        return any(
            "could not check" in r.getMessage() and "refused the check's commands" in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING
        )

    with caplog.at_level(logging.WARNING):
        wait_for(refusal_said, "the warning that the check was refused")
    assert "permissions_denied" not in adapter.stats()


def test_a_cluster_primary_that_denies_multi_is_said_to_refuse_the_check(
    redis_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A primary whose ACL denies MULTI answered the check: it refused it.  The warning
    # says so, rather than that the node did not answer (which would send an operator
    # looking for a network fault); the adapter still opens, as on a single store.
    user = f"nomulti-{uuid.uuid4().hex[:8]}"
    last = len(redis_cluster.nodes) - 1
    for number, node in enumerate(redis_cluster.nodes):
        rules = ["~*", "+@all", "-multi"] if number == last else ["~*", "+@all"]
        node.cli("ACL", "SETUSER", user, "reset", "on", ">nomulti-pw", *rules)
    try:
        with caplog.at_level(logging.WARNING):
            open_adapter(
                startup_nodes=redis_cluster.startup_nodes,
                cluster_mode=True,
                key_prefix=prefix,
                username=user,
                password="nomulti-pw",
            )
    finally:
        for node in redis_cluster.nodes:
            node.cli("ACL", "DELUSER", user)
    unchecked = [r.getMessage() for r in caplog.records if "could not check" in r.getMessage()]
    refusing = redis_cluster.nodes[last].address
    said = f"{refusing}: refused the check's commands (NoPermissionError"
    assert any(said in message for message in unchecked), unchecked
    assert not any("did not answer" in message for message in unchecked), unchecked


def test_several_startup_nodes_without_cluster_mode_warn_once_naming_the_node_used(
    redis_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A standalone client talks to one node: the others listed are not replicas it fails
    # over to, which an operator who listed them may believe (LMCache warns here too).
    used = f"127.0.0.1:{redis_server.port}"
    ignored = ["127.0.0.1:1", "127.0.0.1:2"]
    with caplog.at_level(logging.INFO, logger="lmcache_tiers.l2.redis"):
        adapter = open_adapter(startup_nodes=",".join([used, *ignored]), key_prefix=prefix)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    [warning] = warnings
    # 127.0.0.1:2 is also how 127.0.0.1:25412 starts: a node is named when no digit follows
    named = [re.compile(re.escape(node) + r"(?!\d)") for node in ignored]
    assert f"uses {used} only" in warning and all(node.search(warning) for node in named), warning
    connected = [r.getMessage() for r in caplog.records if "connected to" in r.getMessage()]
    assert connected and not any(node.search(line) for line in connected for node in named), connected
    keys = make_keys(1)
    store(adapter, keys)
    assert client_of(adapter).lookup_and_lock(keys).found == [True]
    adapter.unlock(keys)


def test_one_startup_node_without_cluster_mode_warns_nothing(
    redis_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2.redis"):
        open_adapter(startup_nodes=f"127.0.0.1:{redis_server.port}", key_prefix=prefix)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.usefixtures("brief_tls_checks")
def test_a_denial_found_before_a_fresher_allowing_check_is_not_recorded_after_it(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # Two checks of a store that denied UNLINK overlap as the ACL is fixed: the older
    # finds the denial, the newer (after the fix) allows and is recorded first.  The older
    # verdict, recorded after it, must not count the denial again nor bring it back.
    adapter = _opened_while_hung_denying_unlink(own_server, prefix, open_adapter)
    backend = backend_of(adapter)
    backend._check_owed_permissions()
    assert adapter.stats()["permissions_denied"] == 1, adapter.stats()
    real_check = backend._unchecked_permission_refusals
    older_found, newer_recorded = threading.Event(), threading.Event()

    def older_check(client: Any, **options: Any) -> Any:
        verdict = real_check(client, **options)
        older_found.set()
        newer_recorded.wait(WAIT_S)
        return verdict

    backend._unchecked_permission_refusals = older_check  # type: ignore[method-assign]
    older = threading.Thread(target=backend._check_owed_permissions)
    older.start()
    assert older_found.wait(WAIT_S)
    backend._unchecked_permission_refusals = real_check  # type: ignore[method-assign]
    own_server.cli("ACL", "SETUSER", "limited", "+unlink")
    backend._check_owed_permissions()
    newer_recorded.set()
    older.join(WAIT_S)
    assert backend._denied is None, backend._denied
    assert adapter.stats()["permissions_denied"] == 1, adapter.stats()
    assert adapter.stats()["permission_verdicts_stale"] == 1, adapter.stats()


@pytest.mark.usefixtures("brief_tls_checks")
def test_a_lookup_does_not_wait_for_a_permission_check_another_is_making(
    own_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The check the store owes (it hung at open) is made by the circuit's probe and, once
    # a second (0 here), by a call.  While one check waits on a store slow to answer it,
    # a lookup that claims the next must not queue behind it for the check's timeout: it
    # goes on with the verdict it has (none found yet), counted.
    monkeypatch.setattr(backend_module, "OWED_CHECK_INTERVAL_S", 0.0)
    own_server.pause()
    try:
        adapter = open_adapter(**quick_failing(own_server, prefix, 100))
    finally:
        own_server.resume()
    backend = backend_of(adapter)
    real_refusals = backend_module.permission_refusals
    checking, answer = threading.Event(), threading.Event()

    def slow_refusals(client: redis.Redis, name: str) -> Any:
        checking.set()
        answer.wait(WAIT_S)  # the store slow to answer this check
        return real_refusals(client, name)

    monkeypatch.setattr(backend_module, "permission_refusals", slow_refusals)
    probe = threading.Thread(target=backend.ping)
    probe.start()
    looked_up = threading.Event()
    try:
        assert checking.wait(WAIT_S), "the probe did not check the store it owes a check"
        keys = make_keys(2)
        lookup = threading.Thread(target=lambda: looked_up.set() if backend.contains_many(keys) else None)
        lookup.start()
        assert looked_up.wait(WAIT_S), "the lookup waited for the probe's permission check"
    finally:
        answer.set()
        probe.join(WAIT_S)
    assert adapter.stats().get("permission_checks_skipped_busy", 0) >= 1, adapter.stats()
    assert not backend._permissions_owed, "the probe's check gave its verdict"


def test_a_cluster_primary_that_does_not_answer_its_check_is_not_asked_by_every_call(
    own_cluster: RedisClusterNodes,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A primary hung for good costs the check its timeout: calls that check it again each
    # OWED_CHECK_INTERVAL_S (0 here) would each wait it out.  After a failed check, calls
    # leave it out for a pause growing per failure (60 s here: longer than the test).
    monkeypatch.setattr(backend_module, "OWED_CHECK_INTERVAL_S", 0.0)
    monkeypatch.setattr(backend_module, "NODE_CHECK_PAUSE_FIRST_S", 60.0, raising=False)
    hung = own_cluster.nodes[2]
    asked: list[int] = []
    real_refusals = backend_module.permission_refusals

    def counted_refusals(client: redis.Redis, name: str) -> Any:
        asked.append(client.connection_pool.connection_kwargs["port"])
        return real_refusals(client, name)

    monkeypatch.setattr(backend_module, "permission_refusals", counted_refusals)
    hung.pause()
    try:
        adapter = open_adapter(
            startup_nodes=own_cluster.nodes[0].address,
            cluster_mode=True,
            key_prefix=prefix,
            request_timeout=0.3,
            connection_timeout=0.3,
        )
        backend = backend_of(adapter)
        assert asked.count(hung.port) == 1, asked  # the check at open
        # The start-up scan's listing is a call too: its check is left out of the count.
        wait_for(lambda: not adapter.stats().get("scan_running"), "the start-up scan")
        paused = adapter.stats().get("permission_checks_paused", 0)
        for _ in range(3):
            backend._refuse_calls_while_denied()
        assert asked.count(hung.port) == 1, asked
        assert adapter.stats().get("permission_checks_paused", 0) == paused + 3, adapter.stats()
    finally:
        hung.resume()
    # The circuit's probe checks it whatever the pause: it just answered the probe's PING.
    backend.ping()
    assert asked.count(hung.port) == 2, asked
    assert not backend._permissions_owed


def _replica_of(cluster: RedisClusterNodes, primary: RedisServer, directory: Path) -> RedisServer:
    """A new cluster node on loopback replicating ``primary``, its copy in sync, met by
    every node of ``cluster`` directly: a promotion it announces then reaches them all at
    once (learning of it by gossip takes seconds)."""
    # Redis 7 waits repl-diskless-sync-delay (5 s) for more replicas before a full sync.
    primary.cli("CONFIG", "SET", "repl-diskless-sync-delay", "0")
    replica = RedisServer(directory, cluster=True).start()
    for node in cluster.nodes:
        replica.cli("CLUSTER", "MEET", "127.0.0.1", str(node.port))
    ids = [node.cli("CLUSTER", "MYID").stdout.strip() for node in cluster.nodes]

    def knows_everyone() -> bool:
        # Every node met, each with its slots: a takeover claims the slots the replica
        # knows its primary serves (none, before that news reached it).
        lines = replica.cli("CLUSTER", "NODES").stdout.splitlines()
        known = [line for line in lines if line.split()[0] in ids and " connected" in line]
        return len(known) == len(ids) and all(len(line.split()) > 8 for line in known)

    wait_for(knows_everyone, "the replica to know every node and its slots")
    replica.cli("CLUSTER", "REPLICATE", ids[cluster.nodes.index(primary)])
    wait_for(
        lambda: "master_link_status:up" in replica.cli("INFO", "replication").stdout, "the replica in sync"
    )
    return replica


def _serves_slots(node: RedisServer) -> bool:
    """Whether ``node`` is a cluster primary serving slots, as it sees itself."""
    (own,) = [line for line in node.cli("CLUSTER", "NODES").stdout.splitlines() if "myself" in line]
    return "myself,master" in own and len(own.split()) > 8  # the fields after the 8th: its slots


def test_a_replica_promoted_after_every_primary_was_checked_is_checked(
    own_cluster: RedisClusterNodes,
    tmp_path: Path,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
) -> None:
    # Every primary allowed the user at open; a replica whose ACL denies SET (each node
    # keeps its own) is promoted later.  Its permissions are checked once the client's
    # slot map names it: the denial is counted, not left to fail its stores one by one.
    replica = _replica_of(own_cluster, own_cluster.nodes[0], tmp_path / "replica")
    try:
        user = f"limited-{uuid.uuid4().hex[:8]}"
        for node in own_cluster.nodes:
            node.cli("ACL", "SETUSER", user, "reset", "on", ">limited-pw", "~*", "+@all")
        replica.cli("ACL", "SETUSER", user, "reset", "on", ">limited-pw", "~*", "+@all", "-set")
        adapter = open_adapter(
            startup_nodes=own_cluster.nodes[1].address,
            cluster_mode=True,
            key_prefix=prefix,
            username=user,
            password="limited-pw",
        )
        assert not backend_of(adapter)._permissions_owed
        # TAKEOVER: promoted at once, without waiting for every primary to learn of the
        # replica by gossip and vote (seconds here).
        replica.cli("CLUSTER", "FAILOVER", "TAKEOVER")
        wait_for(lambda: _serves_slots(replica), "the promotion")
        keys = make_keys(16)

        def denial_counted() -> bool:
            with contextlib.suppress(Exception):
                client_of(adapter).store(keys, [memoryview(b"x" * 64)] * len(keys))
            return adapter.stats().get("permissions_denied", 0) > 0

        wait_for(denial_counted, "the check of the promoted primary")
    finally:
        replica.stop()


# -- the string layout's edges ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_a_header_longer_than_the_head_a_lookup_reads_is_read_whole(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # A key near the longest model name and salt makes a record header longer than the
    # head a lookup, a listing or a delete reads: it is read again whole, never taken for
    # damage (which would remove an acknowledged object).
    adapter, backend, raw = adapter_in_mode(request, prefix, open_adapter, mode, max_capacity_gb=1.0)
    keys = [ObjectKey("m" * 256, 0, index.to_bytes(8, "big") * 8, 0, "s" * 128) for index in range(2)]
    data = store(adapter, keys)
    names = [backend.name_of(key) for key in keys]
    assert all(len(header_of(raw, name)) > HEAD_READ for name in names)
    found = client_of(adapter).lookup_and_lock(keys)
    assert found.found == [True, True] and found.sizes == [4096, 4096]
    assert load(adapter, keys, found.sizes) == ([True, True], data)
    adapter.unlock(keys)
    where, _ = shared_store(request, "cluster" if mode == "cluster" else "standalone")
    listing = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    wait_for(lambda: not listing.stats()["scan_running"], "the start-up scan")
    assert listing.used_bytes() == 2 * 4096, "the listing sizes them"
    assert listing.delete(keys) == [True, True]
    assert [raw.exists(name) for name in names] == [0, 0]
    for counted in (adapter, listing):
        assert counted.stats().get("corrupt_records_removed", 0) == 0


@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
def test_an_empty_string_under_a_records_name_reads_as_no_value(
    request: pytest.FixtureRequest, prefix: str, open_adapter: Callable[..., BackendAdapter], mode: str
) -> None:
    # GETRANGE and STRLEN answer an empty value as they answer a missing name, and GET's
    # empty reply is taken the same way: a miss, not damage (nothing counted or removed),
    # as docs/adapters/redis.md says; a store of the key replaces it.
    adapter, backend, raw = adapter_in_mode(request, prefix, open_adapter, mode)
    keys = make_keys(2)
    store(adapter, keys)
    names = [backend.name_of(key) for key in keys]
    for name in names:
        raw.set(name, b"")
    assert client_of(adapter).lookup_and_lock(keys[:1]).found == [False]
    assert load(adapter, keys[1:], [4096])[0] == [False]
    where, _ = shared_store(request, "cluster" if mode == "cluster" else "standalone")
    listing = open_adapter(**where, key_prefix=prefix, max_capacity_gb=1.0)
    wait_for(lambda: not listing.stats()["scan_running"], "the start-up scan")
    assert listing.used_bytes() == 0
    assert [raw.exists(name) for name in names] == [1, 1], "an empty value is left alone"
    for counted in (adapter, listing):
        assert counted.stats().get("corrupt_records_removed", 0) == 0
        assert counted.stats().get("corrupt_remove_failures", 0) == 0
    data = store(adapter, keys[:1])
    assert raw.strlen(names[0]) > 4096, "a store replaces it with a record"
    found = client_of(adapter).lookup_and_lock(keys[:1])
    assert found.found == [True]
    assert load(adapter, keys[:1], found.sizes) == ([True], data)
    adapter.unlock(keys[:1])


@pytest.mark.parametrize("mode", ["direct", "pipelined", "cluster"])
@pytest.mark.parametrize(
    "value",
    [b"x", b"LMTR" + bytes(60), b"LMTR\x01\x00\x00\x00\xff\x0f\x00\x00" + bytes(60)],
    ids=["short", "no-header-length", "header-past-the-value"],
)
def test_a_value_that_holds_no_record_is_a_counted_miss_and_is_removed(
    request: pytest.FixtureRequest,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    mode: str,
    value: bytes,
) -> None:
    # Shorter than a record header's start, a start with an impossible header length, or
    # one whose header would be longer than the value: damage under a record's name, a
    # miss for lookups and loads, counted and removed -- never bytes handed out.
    adapter, backend, raw = adapter_in_mode(request, prefix, open_adapter, mode)
    keys = make_keys(2)
    store(adapter, keys)
    names = [backend.name_of(key) for key in keys]
    for name in names:
        raw.set(name, value)
    assert client_of(adapter).lookup_and_lock(keys[:1]).found == [False]
    assert load(adapter, keys[1:], [4096])[0] == [False]
    assert [raw.exists(name) for name in names] == [0, 0]
    assert adapter.stats()["corrupt_records_removed"] == 2
