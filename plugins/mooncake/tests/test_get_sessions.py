"""Loads into L1 read under Mooncake get sessions, which the client keeps one per name
whoever started them: loads of the same keys running at once must not end each other's
sessions under their reads.  Against a real master."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from closing_in_turn import ClosingInTurn
from lmcache_plugin_mooncake.backend import MooncakeStoreBackend
from lmcache_plugin_mooncake.cluster import LocalCluster
from lmcache_plugin_mooncake.headers import HEADER_BYTES, address_of
from mooncake_helpers import arena_buffers, backend_of, config_for, open_adapter, stored_from_arena

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter

SIZE = 256 << 10
KEYS = 4
THREADS = 4
ROUNDS = 40


@pytest.fixture
def arena() -> memoryview:
    # the stored payloads, then one target per thread and key
    return memoryview(mmap.mmap(-1, (1 + THREADS) * KEYS * SIZE))


@pytest.fixture
def adapter(
    mooncake_pool: LocalCluster, arena: memoryview, closing: ClosingInTurn, request: pytest.FixtureRequest
) -> Iterator[BackendAdapter]:
    opened = open_adapter(config_for(mooncake_pool), l1_buffer=arena)
    closing.opened(opened)
    yield opened
    closing.done([opened], request.node.nodeid)


def test_loads_of_the_same_keys_at_once_all_hit_and_end_every_session(
    adapter: BackendAdapter, arena: memoryview
) -> None:
    """Threads loading the same keys over and over (batches in rotated orders, so their
    sessions start and end interleaved) all read every record whole and verified; once
    they are done no session is left open in the client."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    failures: list[str] = []

    def load_repeatedly(thread: int) -> None:
        targets = arena_buffers(arena, 1 + thread, KEYS, SIZE)
        for round_ in range(ROUNDS):
            order = [(round_ + thread + i) % KEYS for i in range(KEYS)][: 1 + (round_ + thread) % KEYS]
            ok = backend.get_many_into([keys[i] for i in order], [targets[i] for i in order])
            if ok != [True] * len(order):
                failures.append(f"thread {thread} round {round_}: {ok}")
            for i in order:
                if bytes(targets[i]) != data[i]:
                    failures.append(f"thread {thread} round {round_}: key {i} read other bytes")

    threads = [threading.Thread(target=load_repeatedly, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert adapter.stats().get("load_failures", 0) == 0
    assert backend._sessions.open == 0
    assert not _session_left(backend, arena, keys[0]), "a session was left open in the client"


def test_a_load_ending_while_another_of_its_key_reads_leaves_that_ones_session(
    adapter: BackendAdapter, arena: memoryview
) -> None:
    """A load of a key runs whole -- its session started, read and done -- while another
    load of that key sits between its session start and its read: the later read still
    finds the session (the client keeps one per name, and the first end would drop it),
    a hit of the stored bytes; the last of the two ends it."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    real = backend.connection.store()
    started, finished = threading.Event(), threading.Event()
    held: list[threading.Thread] = []

    class HoldFirstRead:
        """The client, but the held thread's read waits for the other load to finish."""

        def __getattr__(self, attribute: str) -> Any:
            return getattr(real, attribute)

        def batch_get_into_multi_buffer_ranges(self, *args: Any) -> list[int]:
            if threading.current_thread() in held:
                started.set()
                assert finished.wait(60), "the other load did not finish"
            return list(real.batch_get_into_multi_buffer_ranges(*args))

    held_client = HoldFirstRead()
    backend.connection.store = lambda: held_client  # type: ignore[method-assign]
    first, second = arena_buffers(arena, 1, KEYS, SIZE), arena_buffers(arena, 2, KEYS, SIZE)
    answers: list[list[bool]] = []
    thread = threading.Thread(target=lambda: answers.append(backend.get_many_into(keys, first)))
    held.append(thread)
    try:
        thread.start()
        assert started.wait(60), "the held load did not reach its read"
        assert backend.get_many_into(keys[:1], second[:1]) == [True]
        finished.set()
        thread.join()
    finally:
        finished.set()
        del backend.connection.store
    assert answers == [[True] * KEYS]
    assert [bytes(target) for target in first] == data
    assert adapter.stats().get("load_failures", 0) == 0
    assert backend._sessions.open == 0
    assert not _session_left(backend, arena, keys[0])


def test_a_load_failing_mid_batch_ends_its_sessions(adapter: BackendAdapter, arena: memoryview) -> None:
    """A read that raises inside the batch (the load fails, a backend error) leaves no
    session counted in the adapter nor open in the client."""
    keys, _ = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    real = backend.connection.store()

    class FailingRead:
        def __getattr__(self, attribute: str) -> Any:
            return getattr(real, attribute)

        def batch_get_into_multi_buffer_ranges(self, *args: Any) -> list[int]:
            raise RuntimeError("transfer engine gone")

    failing_client = FailingRead()
    backend.connection.store = lambda: failing_client  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="transfer engine gone"):
            backend.get_many_into(keys, arena_buffers(arena, 1, KEYS, SIZE))
    finally:
        del backend.connection.store
    assert backend._sessions.open == 0
    assert not any(_session_left(backend, arena, key) for key in keys)


def test_keys_of_a_batch_missing_from_the_pool_are_misses_and_the_rest_hits(
    adapter: BackendAdapter, arena: memoryview, raw: Any
) -> None:
    """Sessions start for some keys of a batch only (the others removed since the
    lookup): each key's answer is its own -- the missing ones misses counted as vanished,
    the others hits of their own bytes -- and every session is ended."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    for gone in (0, 2):
        assert raw.remove(backend.names.of(keys[gone]), True) == 0
    targets = arena_buffers(arena, 1, KEYS, SIZE)
    assert backend.get_many_into(keys, targets) == [False, True, False, True]
    assert [bytes(targets[i]) for i in (1, 3)] == [data[1], data[3]]
    assert adapter.stats().get("load_vanished", 0) == 2
    assert adapter.stats().get("load_failures", 0) == 0
    assert backend._sessions.open == 0
    assert not any(_session_left(backend, arena, keys[i]) for i in (1, 3))


def test_an_object_replaced_between_session_start_and_read_is_never_handed_out(
    adapter: BackendAdapter, arena: memoryview, raw: Any
) -> None:
    """Another party removes the record after the load's session started and puts an
    object of other bytes of the same size (the pool may place it where the record was,
    which the session still reads): the load is a hit of the stored bytes (the old memory
    still held them) or a counted miss, never the other bytes."""
    keys, data = stored_from_arena(adapter, arena, KEYS, SIZE)
    backend = backend_of(adapter)
    real = backend.connection.store()
    name, other = backend.names.of(keys[0]), backend.names.of(keys[0]) + "-other"
    garbage = os.urandom(HEADER_BYTES + SIZE)

    class ReplaceBeforeRead:
        def __getattr__(self, attribute: str) -> Any:
            return getattr(real, attribute)

        def batch_get_into_multi_buffer_ranges(self, *args: Any) -> list[int]:
            assert raw.remove(name, True) == 0 and raw.put(other, garbage) == 0
            return list(real.batch_get_into_multi_buffer_ranges(*args))

    replacing_client = ReplaceBeforeRead()
    backend.connection.store = lambda: replacing_client  # type: ignore[method-assign]
    target = arena_buffers(arena, 1, KEYS, SIZE)[0]
    try:
        (ok,) = backend.get_many_into(keys[:1], [target])
    finally:
        del backend.connection.store
        raw.remove(other, True)
    if ok:
        assert bytes(target) == data[0]
    else:
        stats = adapter.stats()
        counted = ("corrupt_records_removed", "corrupt_reads_replaced", "load_failures", "load_vanished")
        assert sum(stats.get(counter, 0) for counter in counted) == 1, stats
    assert backend._sessions.open == 0


def _session_left(backend: MooncakeStoreBackend, arena: memoryview, key: ObjectKey) -> bool:
    """Whether the adapter's client still holds a get session of ``key``: a read under
    none is refused (-600)."""
    store, slot = backend.connection.store(), arena_buffers(arena, THREADS, KEYS, SIZE)[0]
    with backend.lanes.lane(5.0) as lane:
        codes = store.batch_get_into_multi_buffer_ranges(
            [backend.names.of(key)],
            [[lane.address(0), address_of(slot)]],
            [[HEADER_BYTES, SIZE]],
            [[0, HEADER_BYTES]],
        )
    return bool(codes[0] >= 0)
