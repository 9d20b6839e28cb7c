"""A large load into L1 is read in parts, each verified on a helper thread while the next
is read, all under the get sessions started once for the chunk.  Against a real master."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from closing_in_turn import ClosingInTurn
from lmcache_plugin_mooncake import backend as backend_module
from lmcache_plugin_mooncake.cluster import LocalCluster, NotedCalls
from lmcache_plugin_mooncake.headers import HEADER_BYTES
from mooncake_helpers import arena_buffers, backend_of, config_for, open_adapter, stored_from_arena

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import pattern

SIZE = 64 << 10
KEYS = 16
#: parts of half the bytes left down to 2 records: 8, 4, 2 and 2 records
PART_MIN_BYTES = 2 * SIZE
PARTS = [8, 4, 2, 2]


@pytest.fixture
def arena() -> memoryview:
    # the stored payloads, then the load's targets
    return memoryview(mmap.mmap(-1, 2 * KEYS * SIZE))


@pytest.fixture
def adapter(
    mooncake_pool: LocalCluster,
    arena: memoryview,
    monkeypatch: pytest.MonkeyPatch,
    closing: ClosingInTurn,
    request: pytest.FixtureRequest,
) -> Iterator[BackendAdapter]:
    monkeypatch.setattr(backend_module, "LOAD_PART_MIN_BYTES", PART_MIN_BYTES, raising=False)
    # two cores whatever the machine: a helper thread verifies while the next part is read
    monkeypatch.setattr(backend_module.os, "cpu_count", lambda: 2)
    opened = open_adapter(config_for(mooncake_pool), l1_buffer=arena)
    monkeypatch.undo()
    monkeypatch.setattr(backend_module, "LOAD_PART_MIN_BYTES", PART_MIN_BYTES, raising=False)
    closing.opened(opened)
    yield opened
    closing.done([opened], request.node.nodeid)


def _load(adapter: BackendAdapter, keys: list[ObjectKey], targets: list[memoryview]) -> list[bool]:
    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock(keys).found == [True] * len(keys)
    ok = client.load(keys, targets)
    adapter.unlock(keys)
    return ok


def test_a_large_chunk_is_read_in_parts_under_one_session_start_and_end(
    adapter: BackendAdapter, arena: memoryview, raw: Any
) -> None:
    """Parts of half the bytes left, each its own ranged read, after one session start
    and before one end; a damaged record in the first part and one in the last are
    misses and removed, every other key loads its own bytes."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    damaged = [1, KEYS - 1]
    for index in damaged:
        record = bytearray(encode_header(keys[index], data[index], align=HEADER_BYTES) + data[index])
        record[HEADER_BYTES + SIZE // 2] ^= 0x10
        name = backend.names.of(keys[index])
        assert raw.remove(name, True) == 0 and raw.put(name, bytes(record)) == 0
    called: list[str] = []
    real = backend.connection.store()
    backend.connection.store = lambda: NotedCalls(real, called)  # type: ignore[method-assign]
    targets = arena_buffers(arena, 1, KEYS, SIZE)
    try:
        ok = _load(adapter, keys, targets)
    finally:
        del backend.connection.store
    assert ok == [index not in damaged for index in range(KEYS)]
    assert [bytes(targets[i]) for i in range(KEYS) if ok[i]] == [data[i] for i in range(KEYS) if ok[i]]
    # (the damaged record of the first part is read again and removed meanwhile)
    reads = ["batch_get_into_multi_buffer_ranges"] * len(PARTS)
    sessions = [call for call in called if call.startswith("batch_get_")]
    assert sessions == ["batch_get_session_start", *reads, "batch_get_session_end"]
    assert adapter.stats()["corrupt_records_removed"] == len(damaged)
    assert [raw.is_exist(backend.names.of(keys[i])) for i in damaged] == [0] * len(damaged)
    assert backend._sessions.open == 0


def test_a_part_is_verified_while_the_next_is_read(adapter: BackendAdapter, arena: memoryview) -> None:
    """The second part's read waits until a record of the first part is verified: the
    load completes only if that verification runs during the read, not after it."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    real_store, real_check = backend.connection.store(), backend._verified
    first_verified = threading.Event()
    reads: list[int] = []

    def verified(store: Any, key: ObjectKey, *args: Any) -> bool:
        if key in keys[: PARTS[0]]:
            first_verified.set()
        return real_check(store, key, *args)

    class SecondReadWaits:
        def __getattr__(self, attribute: str) -> Any:
            return getattr(real_store, attribute)

        def batch_get_into_multi_buffer_ranges(self, names: list[str], *args: Any) -> list[int]:
            reads.append(len(names))
            if len(reads) == 2:
                assert first_verified.wait(60), "the first part was not verified during the second read"
            return list(real_store.batch_get_into_multi_buffer_ranges(names, *args))

    waiting = SecondReadWaits()
    backend.connection.store = lambda: waiting  # type: ignore[method-assign]
    backend._verified = verified  # type: ignore[method-assign]
    targets = arena_buffers(arena, 1, KEYS, SIZE)
    try:
        assert backend.get_many_into(keys, targets) == [True] * KEYS
    finally:
        del backend.connection.store, backend._verified
    assert reads == PARTS
    assert [bytes(target) for target in targets] == data


def test_a_failed_read_of_a_later_part_fails_the_load_once_the_first_is_verified(
    adapter: BackendAdapter, arena: memoryview
) -> None:
    """The second part's read raises: the load raises, but only once the first part's
    verification ended (it reads the header lane, which is given back after it), and no
    session is left open."""
    keys, _ = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    real_store, real_check = backend.connection.store(), backend._verified
    lanes = backend.lanes.free
    verifications: list[tuple[int, bool]] = []
    raised, failing_read = threading.Event(), threading.Event()
    reads: list[int] = []

    def verified(*args: Any) -> bool:
        # held until the failing read: the first part is still verified when it raises
        assert failing_read.wait(60)
        verified = real_check(*args)
        verifications.append((backend.lanes.free, raised.is_set()))
        return verified

    class SecondReadFails:
        def __getattr__(self, attribute: str) -> Any:
            return getattr(real_store, attribute)

        def batch_get_into_multi_buffer_ranges(self, *args: Any) -> list[int]:
            reads.append(1)
            if len(reads) == 2:
                failing_read.set()
                raise RuntimeError("transfer engine gone")
            return list(real_store.batch_get_into_multi_buffer_ranges(*args))

    failing = SecondReadFails()
    backend.connection.store = lambda: failing  # type: ignore[method-assign]
    backend._verified = verified  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="transfer engine gone"):
            backend.get_many_into(keys, arena_buffers(arena, 1, KEYS, SIZE))
        raised.set()
    finally:
        del backend.connection.store, backend._verified
    assert verifications == [(lanes - 1, False)] * PARTS[0], "verified with the lane held, before the raise"
    assert backend.lanes.free == lanes
    assert backend._sessions.open == 0


def test_a_load_stops_between_its_parts_once_the_adapter_closes(
    adapter: BackendAdapter, arena: memoryview
) -> None:
    """Closing begins during the first part's read: the parts read are verified and
    loaded, the rest are not read (a close must not wait for one Mooncake call after
    another), each of their keys a miss counted once."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    real_store = backend.connection.store()
    reads: list[int] = []

    class ClosingDuringTheFirstRead:
        def __getattr__(self, attribute: str) -> Any:
            return getattr(real_store, attribute)

        def batch_get_into_multi_buffer_ranges(self, names: list[str], *args: Any) -> list[int]:
            reads.append(len(names))
            backend.context._state.closing.set()  # what the adapter's close sets first
            return list(real_store.batch_get_into_multi_buffer_ranges(names, *args))

    closing = ClosingDuringTheFirstRead()
    backend.connection.store = lambda: closing  # type: ignore[method-assign]
    targets = arena_buffers(arena, 1, KEYS, SIZE)
    try:
        ok = backend.get_many_into(keys, targets)
    finally:
        del backend.connection.store
    assert reads == PARTS[:1], "calls were made after closing began"
    assert ok == [index < PARTS[0] for index in range(KEYS)]
    assert [bytes(target) for target in targets[: PARTS[0]]] == data[: PARTS[0]]
    assert adapter.stats()["load_skipped_closing"] == KEYS - PARTS[0]
    assert backend._sessions.open == 0


def test_on_one_core_a_large_chunk_is_one_read(
    mooncake_pool: LocalCluster, arena: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One core: no helper thread to verify a part on while the next is read (none is
    started, so a part handed to one would never be verified), so the chunk is one read,
    verified on the calling thread."""
    monkeypatch.setattr(backend_module, "LOAD_PART_MIN_BYTES", PART_MIN_BYTES, raising=False)
    monkeypatch.setattr(backend_module.os, "cpu_count", lambda: 1)
    adapter = open_adapter(config_for(mooncake_pool), l1_buffer=arena)
    try:
        keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
        backend = backend_of(adapter)
        called: list[str] = []
        real = backend.connection.store()
        backend.connection.store = lambda: NotedCalls(real, called)  # type: ignore[method-assign]

        def no_helper(*args: Any) -> Any:
            raise AssertionError("work handed to a helper thread on one core")

        backend._load_helpers.submit = no_helper  # type: ignore[method-assign]
        targets = arena_buffers(arena, 1, KEYS, SIZE)
        try:
            assert backend.get_many_into(keys, targets) == [True] * KEYS
        finally:
            del backend.connection.store, backend._load_helpers.submit
        assert called.count("batch_get_into_multi_buffer_ranges") == 1
        assert [bytes(target) for target in targets] == data
    finally:
        adapter.close()


def test_a_damaged_record_replaced_under_the_open_session_is_judged_on_the_new_object(
    adapter: BackendAdapter, arena: memoryview, raw: Any
) -> None:
    """A damaged record of the first part is replaced by another writer's valid record
    (at other memory: the freed one taken first) while the first part is read; it is
    judged while the chunk's sessions are still open, which keep the old replica: the
    judgment reads the object again from the master's answer, finds it replaced and keeps
    it -- removing it would lose that writer's acknowledged store."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    name = backend.names.of(keys[1])
    damaged = bytearray(encode_header(keys[1], data[1], align=HEADER_BYTES) + data[1])
    damaged[HEADER_BYTES + SIZE // 2] ^= 0x10
    assert raw.remove(name, True) == 0 and raw.put(name, bytes(damaged)) == 0
    newer = pattern(KEYS + 1, SIZE)
    real_store, real_judge = backend.connection.store(), backend._remove_damaged
    reads: list[int] = []
    judged = threading.Event()

    def remove_damaged(*args: Any, **kwargs: Any) -> None:
        real_judge(*args, **kwargs)
        judged.set()

    class ReplacedDuringTheFirstRead:
        def __getattr__(self, attribute: str) -> Any:
            return getattr(real_store, attribute)

        def batch_get_into_multi_buffer_ranges(self, names: list[str], *args: Any) -> list[int]:
            if reads:  # the first part's damage is judged while the sessions are open
                assert judged.wait(60), "the damaged record was not judged during the second read"
            codes = list(real_store.batch_get_into_multi_buffer_ranges(names, *args))
            reads.append(len(names))
            if len(reads) == 1:
                assert raw.remove(name, True) == 0
                assert raw.put(name + "-filler", bytes(len(damaged))) == 0
                assert raw.put(name, encode_header(keys[1], newer, align=HEADER_BYTES) + newer) == 0
            return codes

    replacing = ReplacedDuringTheFirstRead()
    backend.connection.store = lambda: replacing  # type: ignore[method-assign]
    backend._remove_damaged = remove_damaged  # type: ignore[method-assign]
    targets = arena_buffers(arena, 1, KEYS, SIZE)
    try:
        ok = backend.get_many_into(keys, targets)
    finally:
        del backend.connection.store, backend._remove_damaged
        raw.remove(name + "-filler", True)
    assert reads == PARTS
    assert ok == [index != 1 for index in range(KEYS)]
    stats = adapter.stats()
    assert stats.get("corrupt_reads_replaced", 0) == 1 and stats.get("corrupt_records_removed", 0) == 0, stats
    assert raw.is_exist(name) == 1, "the other writer's record was removed"
    assert backend.get_many_into(keys[1:2], targets[1:2]) == [True] and bytes(targets[1]) == newer
    assert backend._sessions.open == 0
