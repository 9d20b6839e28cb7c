"""Loads into an L1 arena registered with the client: each record is read as two ranged
reads (header into its lane slot, payload into L1), which -- unlike a whole-object read
-- do not fail on an object larger than the ranges.  Against a real master."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any

import pytest
from closing_in_turn import ClosingInTurn
from lmcache_plugin_mooncake.cluster import LocalCluster, NotedCalls
from lmcache_plugin_mooncake.headers import HEADER_BYTES
from mooncake_helpers import backend_of, config_for, open_adapter

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10
#: L1 of the adapters here: room for a few objects of twice SIZE
ARENA_BYTES = 16 * SIZE


@pytest.fixture
def arena() -> memoryview:
    return memoryview(mmap.mmap(-1, ARENA_BYTES))


@pytest.fixture
def adapter(
    mooncake_pool: LocalCluster, arena: memoryview, closing: ClosingInTurn, request: pytest.FixtureRequest
) -> Iterator[BackendAdapter]:
    opened = open_adapter(config_for(mooncake_pool), l1_buffer=arena)
    closing.opened(opened)
    yield opened
    closing.done([opened], request.node.nodeid)


def _slots(arena: memoryview, sizes: list[int]) -> list[memoryview]:
    """Disjoint L1 buffers of ``sizes``, one after another in the arena."""
    views, start = [], 0
    for size in sizes:
        views.append(arena[start : start + size])
        start += size
    return views


def _record(key: ObjectKey, payload: bytes) -> bytes:
    return encode_header(key, payload, align=HEADER_BYTES) + payload


def _stored(adapter: BackendAdapter, arena: memoryview, keys: list[ObjectKey]) -> list[bytes]:
    data = [pattern(i, SIZE) for i in range(len(keys))]
    sources = _slots(arena, [SIZE] * len(keys))
    for source, payload in zip(sources, data, strict=True):
        source[:] = payload
    assert BlockingAdapterClient(adapter).store(keys, sources) == [True] * len(keys)
    arena[:] = bytes(arena.nbytes)
    return data


def _load(adapter: BackendAdapter, arena: memoryview, keys: list[ObjectKey], sizes: list[int]) -> list[bool]:
    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock(keys).found == [True] * len(keys)
    ok = client.load(keys, _slots(arena, sizes))
    adapter.unlock(keys)
    return ok


def test_a_batch_loads_into_l1_by_ranged_reads(adapter: BackendAdapter, arena: memoryview) -> None:
    """The payloads land in L1 buffers scattered over the arena (not in key order, the
    lowest not at the arena's start: offsets from it, not from the registered base), intact."""
    keys = make_keys(3)
    data = _stored(adapter, arena, keys)
    backend = backend_of(adapter)
    called: list[str] = []
    real = backend.connection.store()
    backend.connection.store = lambda: NotedCalls(real, called)  # type: ignore[method-assign]
    try:
        # key 0 at the end of the used span, key 2 at its start: offsets from the lowest
        targets = _slots(arena[SIZE // 2 :], [SIZE] * 3)[::-1]
        client = BlockingAdapterClient(adapter)
        assert client.lookup_and_lock(keys).found == [True] * 3
        assert client.load(keys, targets) == [True] * 3
        adapter.unlock(keys)
    finally:
        del backend.connection.store
    assert [bytes(target) for target in targets] == data
    # after the lookup's existence query: one session start (the master asked once for
    # the whole batch), one ranged read of every record, the sessions ended
    assert called == [
        "batch_is_exist",
        "batch_get_session_start",
        "batch_get_into_multi_buffer_ranges",
        "batch_get_session_end",
    ]


def test_an_object_replaced_by_a_larger_record_is_a_miss_kept_and_sized_again(
    adapter: BackendAdapter, arena: memoryview, raw: Any
) -> None:
    """A ranged read of an object another writer replaced with a larger record reads a
    prefix of it: its header disagrees with the size read, and the object is neither
    handed out nor removed as damage; the next lookup asks the master for its size."""
    (key,) = make_keys(1)
    _stored(adapter, arena, [key])
    bigger = pattern(9, 2 * SIZE)
    name = backend_of(adapter).names.of(key)
    assert raw.remove(name, True) == 0 and raw.put(name, _record(key, bigger)) == 0

    assert _load(adapter, arena, [key], [SIZE]) == [False]
    assert raw.is_exist(name) == 1, "another writer's valid record is not removed"
    assert adapter.stats().get("corrupt_records_removed", 0) == 0

    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock([key]).sizes == [2 * SIZE], "sized by the master this time"
    (target,) = _slots(arena, [2 * SIZE])
    assert client.load([key], [target]) == [True]
    adapter.unlock([key])
    assert bytes(target) == bigger


def test_an_object_replaced_by_a_smaller_record_is_a_miss(
    adapter: BackendAdapter, arena: memoryview, raw: Any
) -> None:
    (key,) = make_keys(1)
    _stored(adapter, arena, [key])
    name = backend_of(adapter).names.of(key)
    assert raw.remove(name, True) == 0 and raw.put(name, _record(key, pattern(3, SIZE // 2))) == 0
    assert _load(adapter, arena, [key], [SIZE]) == [False]
    assert adapter.stats()["load_failures"] == 1
    assert raw.is_exist(name) == 1


@pytest.mark.parametrize("damage", ["payload_byte", "payload_length", "garbage"])
def test_a_damaged_record_read_into_l1_is_a_miss_and_is_removed(
    adapter: BackendAdapter, arena: memoryview, raw: Any, damage: str
) -> None:
    (key,) = make_keys(1)
    _stored(adapter, arena, [key])
    name = backend_of(adapter).names.of(key)
    payload = pattern(5, SIZE)
    record = {
        "payload_byte": bytearray(_record(key, payload)),
        # a header of a shorter payload over an object of the size core accounts
        "payload_length": bytearray(_record(key, payload[:-100])[:HEADER_BYTES] + payload),
        "garbage": bytearray(pattern(8, HEADER_BYTES + SIZE)),
    }[damage]
    if damage == "payload_byte":
        record[HEADER_BYTES + 1000] ^= 0x01
    assert raw.remove(name, True) == 0 and raw.put(name, bytes(record)) == 0
    assert _load(adapter, arena, [key], [SIZE]) == [False]
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert raw.is_exist(name) == 0, "the damaged object was removed from the pool"


def test_a_batch_with_empty_payloads_loads_into_l1(adapter: BackendAdapter, arena: memoryview) -> None:
    """Records of empty payloads are headers alone: only their header range is read."""
    keys = make_keys(3)
    data = [b"", pattern(1, SIZE), b""]
    sources = _slots(arena, [len(payload) for payload in data])
    for source, payload in zip(sources, data, strict=True):
        source[:] = payload
    assert BlockingAdapterClient(adapter).store(keys, sources) == [True] * 3
    arena[:] = bytes(arena.nbytes)
    targets = _slots(arena, [len(payload) for payload in data])
    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock(keys).found == [True] * 3
    assert client.load(keys, targets) == [True] * 3
    assert client.load(keys[:1], targets[:1]) == [True], "a batch of empty payloads alone"
    adapter.unlock(keys)
    assert [bytes(target) for target in targets] == data


class _SizesUnanswered(NotedCalls):
    """The adapter's client whose replica queries the master leaves unanswered (``{}``,
    as Mooncake answers when its master RPC fails) while the objects exist."""

    def batch_get_replica_desc(self, names: list[str]) -> dict[str, Any]:
        self.called.append("batch_get_replica_desc")
        return {}


def test_a_larger_record_whose_size_cannot_be_asked_again_is_kept(
    adapter: BackendAdapter, arena: memoryview, raw: Any
) -> None:
    """A ranged read never learns an object's size: a header disagreeing with the bytes
    read is damage only once the master says the object is of the size read.  Unasked,
    the object may be another writer's larger record, whose store it acknowledged: a
    miss, counted, kept -- and its next lookup asks the master for its size."""
    (key,) = make_keys(1)
    _stored(adapter, arena, [key])
    bigger = pattern(9, 2 * SIZE)
    backend = backend_of(adapter)
    name = backend.names.of(key)
    assert raw.remove(name, True) == 0 and raw.put(name, _record(key, bigger)) == 0

    called: list[str] = []
    real = backend.connection.store()
    backend.connection.store = lambda: _SizesUnanswered(real, called)  # type: ignore[method-assign]
    try:
        assert _load(adapter, arena, [key], [SIZE]) == [False]
    finally:
        del backend.connection.store
    assert "batch_get_replica_desc" in called, "the size was asked again"
    assert raw.is_exist(name) == 1, "another writer's valid record is not removed"
    assert adapter.stats().get("corrupt_records_removed", 0) == 0
    assert adapter.stats()["load_failures"] == 1

    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock([key]).sizes == [2 * SIZE], "sized by the master this time"
    adapter.unlock([key])
