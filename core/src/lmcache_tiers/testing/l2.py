"""Conformance suite of L2 adapters.

An adapter plugin's tests subclass :class:`L2AdapterSuite`, name the component and
declare what it supports::

    class TestMock(L2AdapterSuite):
        component_name = "mock"
        capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

        def make_config(self) -> MockConfig:
            return MockConfig(max_size_gb=1 / 4096, namespace=uuid.uuid4().hex)

The default ``adapter`` fixture builds the component through the installed registry with
``make_config()`` and an :class:`~lmcache_tiers.l2.AdapterContext` whose ``l1_buffer`` is
the suite's ``l1_buffer`` fixture, the way the StorageManager does (the factory's backend
wrapped in core's adapter); every buffer the suite stores from or loads into is a slice
of it, so backends that need L1 buffers (NIXL) run the same tests.  Override the
``adapter`` fixture (fresh and empty storage per test) when construction needs more, and
``reopen_adapter`` (a callable: close the given adapter, open a new one over the same
storage) when the default -- the same config again -- does not reach the same storage.

Everything goes through the non-blocking interface; results are awaited on the eventfds
with a generous timeout that only guards against hangs (no timing is asserted).
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, L2Op, create_adapter
from lmcache_tiers.registry import Kind
from lmcache_tiers.testing.base import ComponentSuite, capability, requires
from lmcache_tiers.testing.blocking import BlockingAdapterClient

#: objects survive ``close()`` and are found, loadable and accounted after reopening
PERSISTENCE = capability("persistence")
#: ``usage()`` is a fraction of a finite capacity and a store that does not fit fails
CAPACITY = capability("capacity")
#: deleting objects frees capacity, so stores that failed for lack of room succeed again
EVICTION = capability("eviction")

Reopen = Callable[[L2Adapter], L2Adapter]


def make_keys(count: int, *, start: int = 0, salt: str = "", model: str = "suite-model") -> list[ObjectKey]:
    """Distinct keys of one prompt in prefix order."""
    return [ObjectKey(model, 0, index.to_bytes(8, "big"), 0, salt) for index in range(start, start + count)]


def pattern(seed: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes, different for every seed."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class BufferPool:
    """Bump allocator over the suite's L1 buffer: every test buffer is a slice of it."""

    def __init__(self, arena: memoryview) -> None:
        self.arena = arena
        self.offset = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        with self._lock:
            start = -(-self.offset // 64) * 64
            if start + size > self.arena.nbytes:
                raise MemoryError(
                    f"suite L1 buffer exhausted ({self.arena.nbytes} bytes); raise l1_buffer_size"
                )
            self.offset = start + size
            return self.arena[start : start + size]

    def filled(self, data: bytes) -> memoryview:
        view = self.take(len(data))
        view[:] = data
        return view


class RecordingListener:
    """Collects every notification, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, L2Adapter, list[ObjectKey]]] = []
        self._lock = threading.Lock()

    def _add(self, kind: str, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self.events.append((kind, adapter, list(keys)))

    def on_l2_keys_stored(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._add("stored", adapter, keys)

    def on_l2_keys_loaded(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._add("loaded", adapter, keys)

    def on_l2_keys_deleted(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._add("deleted", adapter, keys)

    def keys(self, kind: str) -> list[ObjectKey]:
        with self._lock:
            return [key for event, _, keys in self.events if event == kind for key in keys]


class L2AdapterSuite(ComponentSuite):
    """Behaviour every L2 adapter must show through the non-blocking interface."""

    kind = Kind.L2_ADAPTER
    #: size of the objects the suite stores (a few sizes around it are used too)
    object_size: ClassVar[int] = 16 << 10
    #: bytes of the suite's stand-in L1 arena
    l1_buffer_size: ClassVar[int] = 64 << 20
    #: guard against hangs while waiting for a task; never a performance expectation
    wait_timeout_s: ClassVar[float] = 60.0
    #: capacity tests give up (and fail) if this many objects all fit
    max_fill_objects: ClassVar[int] = 512

    # -- fixtures and hooks a plugin may override ---------------------------------------

    def make_config(self) -> L2AdapterConfig:
        """Config of the adapter under test: the Struct's defaults unless overridden."""
        config_type: Any = self.registered_component().config
        config: L2AdapterConfig = config_type()
        return config

    def make_context(self, config: L2AdapterConfig, l1_buffer: memoryview) -> AdapterContext:
        return AdapterContext(index=0, name=f"0:{self.component_name}", config=config, l1_buffer=l1_buffer)

    def open_adapter(self, config: L2AdapterConfig, l1_buffer: memoryview) -> L2Adapter:
        return create_adapter(
            self.registered_component().load(),
            config,
            self.make_context(config, l1_buffer),
            registry=self.registry(),
            type_name=self.component_name,
        )

    @pytest.fixture
    def l1_buffer(self) -> memoryview:
        return memoryview(bytearray(self.l1_buffer_size))

    @pytest.fixture
    def pool(self, l1_buffer: memoryview) -> BufferPool:
        return BufferPool(l1_buffer)

    @pytest.fixture
    def opened(self) -> Iterator[list[L2Adapter]]:
        """Every adapter a test opened; all closed at teardown."""
        adapters: list[L2Adapter] = []
        yield adapters
        for adapter in adapters:
            adapter.close()

    @pytest.fixture
    def adapter(self, l1_buffer: memoryview, opened: list[L2Adapter]) -> L2Adapter:
        adapter = self.open_adapter(self.make_config(), l1_buffer)
        opened.append(adapter)
        return adapter

    @pytest.fixture
    def reopen_adapter(self, l1_buffer: memoryview, opened: list[L2Adapter]) -> Reopen:
        def reopen(previous: L2Adapter) -> L2Adapter:
            config = getattr(previous, "config", None) or self.make_config()
            previous.close()
            adapter = self.open_adapter(config, l1_buffer)
            opened.append(adapter)
            return adapter

        return reopen

    # -- helpers ---------------------------------------------------------------------------

    def client(self, adapter: L2Adapter) -> BlockingAdapterClient:
        return BlockingAdapterClient(adapter, timeout=self.wait_timeout_s)

    def sizes(self, count: int) -> list[int]:
        """Object sizes of a batch: not all equal, so a size mix-up shows."""
        return [self.object_size - (index % 3) * 1000 - index for index in range(count)]

    def store(
        self,
        adapter: L2Adapter,
        pool: BufferPool,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int] | None = None,
        *,
        seed: int = 0,
    ) -> tuple[list[bool], list[bytes]]:
        sizes = list(sizes) if sizes is not None else self.sizes(len(keys))
        data = [pattern(seed * 100_003 + index, size) for index, size in enumerate(sizes)]
        ok = self.client(adapter).store(keys, [pool.filled(d) for d in data])
        return ok, data

    def load(
        self, adapter: L2Adapter, pool: BufferPool, keys: Sequence[ObjectKey], sizes: Sequence[int]
    ) -> tuple[list[bool], list[bytes]]:
        buffers = [pool.take(size) for size in sizes]
        ok = self.client(adapter).load(keys, buffers)
        return ok, [bytes(b) for b in buffers]

    def assert_no_pins(self, adapter: L2Adapter) -> None:
        pinned = getattr(adapter, "pinned_keys", None)
        if pinned is not None:
            assert pinned() == {}, "pins left behind"

    def wait_scanned(self, adapter: L2Adapter) -> None:
        """Wait until the start-up scan of the backend's listing has finished."""
        deadline = time.monotonic() + self.wait_timeout_s
        while adapter.stats().get("scan_running", 0):
            assert time.monotonic() < deadline, "the start-up scan never finished"
            time.sleep(0.01)

    # -- the round trip --------------------------------------------------------------------

    def test_store_lookup_load_round_trip(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(4)
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * 4
        found = self.client(adapter).lookup_and_lock(keys)
        assert found.found == [True] * 4
        assert found.sizes == [len(d) for d in data]
        loaded, contents = self.load(adapter, pool, keys, found.sizes)
        assert loaded == [True] * 4
        assert contents == data
        adapter.unlock(keys)
        self.assert_no_pins(adapter)

    def test_lookup_of_absent_keys_misses(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(3, start=100)
        result = self.client(adapter).lookup_and_lock(keys)
        assert result.found == [False] * 3
        assert result.sizes == [0] * 3
        loaded, _ = self.load(adapter, pool, keys, [self.object_size] * 3)
        assert loaded == [False] * 3
        self.assert_no_pins(adapter)

    def test_partial_hits(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(5)
        ok, data = self.store(adapter, pool, [keys[0], keys[2], keys[3]])
        assert ok == [True] * 3
        result = self.client(adapter).lookup_and_lock(keys)
        assert result.found == [True, False, True, True, False]
        assert result.sizes == [len(data[0]), 0, len(data[1]), len(data[2]), 0]
        sizes = [size or self.object_size for size in result.sizes]
        loaded, contents = self.load(adapter, pool, keys, sizes)
        assert loaded == [True, False, True, True, False]
        assert [contents[0], contents[2], contents[3]] == data
        adapter.unlock([k for k, hit in zip(keys, result.found, strict=True) if hit])
        self.assert_no_pins(adapter)

    def test_empty_batches(self, adapter: L2Adapter) -> None:
        client = self.client(adapter)
        assert client.store([], []) == []
        assert client.lookup_and_lock([]) == ([], [])
        assert client.load([], []) == []
        assert adapter.delete([]) == []

    def test_mismatched_buffer_count_is_refused(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(2)
        with pytest.raises(ValueError):
            adapter.submit_store(keys, [pool.take(10)])
        with pytest.raises(ValueError):
            adapter.submit_load(keys, [pool.take(10)])

    def test_wrong_size_load_buffer_fails_that_key_only(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(2)
        _, data = self.store(adapter, pool, keys)
        result = self.client(adapter).lookup_and_lock(keys)
        loaded, contents = self.load(adapter, pool, keys, [result.sizes[0] - 1, result.sizes[1]])
        assert loaded == [False, True]
        assert contents[1] == data[1]
        adapter.unlock(keys)

    def test_overwrite_replaces_object_and_accounting(self, adapter: L2Adapter, pool: BufferPool) -> None:
        (key,) = make_keys(1)
        self.store(adapter, pool, [key], [self.object_size], seed=1)
        ok, data = self.store(adapter, pool, [key], [self.object_size // 2], seed=2)
        assert ok == [True]
        result = self.client(adapter).lookup_and_lock([key])
        assert result.sizes == [self.object_size // 2]
        loaded, contents = self.load(adapter, pool, [key], result.sizes)
        assert loaded == [True] and contents == data
        adapter.unlock([key])
        assert adapter.used_bytes() == self.object_size // 2

    # -- pins and delete ---------------------------------------------------------------------

    def test_pins_between_lookup_and_load_block_delete(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(2)
        _, data = self.store(adapter, pool, keys)
        result = self.client(adapter).lookup_and_lock([keys[0]])
        assert result.found == [True]
        assert adapter.delete(keys) == [False, True]
        loaded, contents = self.load(adapter, pool, [keys[0]], result.sizes)
        assert loaded == [True] and contents == [data[0]]
        assert adapter.delete([keys[0]]) == [False], "a load must not consume the lookup's pin"
        adapter.unlock([keys[0]])
        assert adapter.delete([keys[0]]) == [True]
        assert self.client(adapter).lookup_and_lock(keys).found == [False, False]
        self.assert_no_pins(adapter)

    def test_pins_are_counted(self, adapter: L2Adapter, pool: BufferPool) -> None:
        (key,) = make_keys(1)
        self.store(adapter, pool, [key])
        client = self.client(adapter)
        assert client.lookup_and_lock([key]).found == [True]
        assert client.lookup_and_lock([key]).found == [True]
        adapter.unlock([key])
        assert adapter.delete([key]) == [False]
        adapter.unlock([key])
        assert adapter.delete([key]) == [True]

    def test_unlock_of_unpinned_keys_is_harmless(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(2)
        self.store(adapter, pool, keys[:1])
        adapter.unlock(keys)
        adapter.unlock(keys)
        assert adapter.delete(keys) == [True, False]
        self.assert_no_pins(adapter)

    def test_delete_reports_per_key(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(3)
        self.store(adapter, pool, [keys[0], keys[2]])
        assert adapter.delete(keys) == [True, False, True]
        assert adapter.delete(keys) == [False, False, False]
        assert self.client(adapter).lookup_and_lock(keys).found == [False] * 3

    # -- accounting, salts, keys -----------------------------------------------------------

    def test_byte_accounting_total_and_by_salt(self, adapter: L2Adapter, pool: BufferPool) -> None:
        assert adapter.used_bytes() == 0
        plain = make_keys(2)
        salted = make_keys(3, salt="tenant-a")
        plain_sizes, salted_sizes = [1000, 2000], [300, 400, 500]
        assert self.store(adapter, pool, plain, plain_sizes)[0] == [True] * 2
        assert self.store(adapter, pool, salted, salted_sizes)[0] == [True] * 3
        assert adapter.used_bytes() == 4200
        assert _nonzero(adapter.used_bytes_by_salt()) == {"": 3000, "tenant-a": 1200}
        self._check_usage(adapter)
        assert adapter.delete([plain[0], salted[2]]) == [True, True]
        assert adapter.used_bytes() == 2700
        assert _nonzero(adapter.used_bytes_by_salt()) == {"": 2000, "tenant-a": 700}
        adapter.delete(plain + salted)
        assert adapter.used_bytes() == 0
        assert _nonzero(adapter.used_bytes_by_salt()) == {}

    def _check_usage(self, adapter: L2Adapter) -> None:
        usage = adapter.usage()
        if CAPACITY in self.capabilities:
            assert 0.0 < usage <= 1.0
        else:
            assert usage == -1.0 or 0.0 <= usage <= 1.0

    def test_cache_salt_isolates_tenants(self, adapter: L2Adapter, pool: BufferPool) -> None:
        (mine,) = make_keys(1, salt="tenant-a")
        (other,) = make_keys(1, salt="tenant-b")
        (unsalted,) = make_keys(1)
        self.store(adapter, pool, [mine])
        result = self.client(adapter).lookup_and_lock([other, unsalted, mine])
        assert result.found == [False, False, True]
        loaded, _ = self.load(adapter, pool, [other, unsalted], [self.object_size] * 2)
        assert loaded == [False, False]
        adapter.unlock([mine])
        assert adapter.delete([other, unsalted]) == [False, False]
        assert self.client(adapter).lookup_and_lock([mine]).found == [True]
        adapter.unlock([mine])

    def test_iter_keys_lists_stored_keys(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(4) + make_keys(2, salt="tenant-a")
        self.store(adapter, pool, keys)
        assert set(adapter.iter_keys()) == set(keys)
        adapter.delete(keys[:3])
        assert set(adapter.iter_keys()) == set(keys[3:])

    # -- listeners ---------------------------------------------------------------------------

    def test_listeners_see_stores_loads_and_deletes(self, adapter: L2Adapter, pool: BufferPool) -> None:
        listener = RecordingListener()
        adapter.add_listener(listener)
        keys = make_keys(3)
        self.store(adapter, pool, keys[:2])
        assert listener.keys("stored") == keys[:2]
        result = self.client(adapter).lookup_and_lock(keys)
        self.load(adapter, pool, keys, [size or 1 for size in result.sizes])
        assert listener.keys("loaded") == keys[:2]
        adapter.unlock(keys[:2])
        adapter.delete(keys)
        assert listener.keys("deleted") == keys[:2]
        assert all(source is adapter for _, source, _ in listener.events)

    # -- the non-blocking plumbing ---------------------------------------------------------

    def test_event_fds_signal_completion(self, adapter: L2Adapter, pool: BufferPool) -> None:
        fds = {op: adapter.event_fd(op) for op in L2Op}
        assert len(set(fds.values())) == len(L2Op), "one eventfd per operation kind"
        task_id = adapter.submit_store(make_keys(1), [pool.filled(b"x" * 100)])
        collected: dict[int, list[bool]] = {}
        while task_id not in collected:
            readable, _, _ = select.select([fds[L2Op.STORE]], [], [], self.wait_timeout_s)
            assert readable, "store completed but its eventfd never became readable"
            collected.update(adapter.pop_completed_stores())
        assert collected[task_id] == [True]
        assert adapter.pop_completed_stores() == {}

    def test_task_ids_are_unique(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(1)
        ids = [
            adapter.submit_store(keys, [pool.filled(b"a" * 10)]),
            adapter.submit_lookup_and_lock(keys),
            adapter.submit_load(keys, [pool.take(10)]),
            adapter.submit_store(keys, [pool.filled(b"b" * 10)]),
        ]
        assert len(set(ids)) == len(ids)
        client = self.client(adapter)
        for op, task_id in zip([L2Op.STORE, L2Op.LOOKUP, L2Op.LOAD, L2Op.STORE], ids, strict=True):
            client.wait(op, task_id)
        adapter.unlock(keys * 2)

    def test_concurrent_submits_from_two_threads(self, adapter: L2Adapter, pool: BufferPool) -> None:
        client = self.client(adapter)
        stored: dict[ObjectKey, bytes] = {}
        stored_lock = threading.Lock()
        errors: list[str] = []
        done = threading.Event()

        def store_controller() -> None:
            try:
                for batch in range(8):
                    keys = make_keys(4, start=batch * 4)
                    data = [pattern(1000 + batch * 4 + i, self.object_size // 4) for i in range(4)]
                    ok = client.store(keys, [pool.filled(d) for d in data])
                    if ok != [True] * 4:
                        errors.append(f"store batch {batch} -> {ok}")
                    with stored_lock:
                        stored.update(zip(keys, data, strict=True))
            except Exception as exc:
                errors.append(f"store thread: {exc!r}")
            finally:
                done.set()

        def prefetch_controller() -> None:
            try:
                rounds = 0
                while not done.is_set() or rounds < 2:
                    rounds += 1 if done.is_set() else 0
                    keys = make_keys(32)
                    result = client.lookup_and_lock(keys)
                    hits = [k for k, hit in zip(keys, result.found, strict=True) if hit]
                    sizes = [s for s in result.sizes if s]
                    buffers = [pool.take(s) for s in sizes]
                    loaded = client.load(hits, buffers)
                    adapter.unlock(hits)
                    with stored_lock:
                        expected = [stored.get(k) for k in hits]
                    for key, ok, buffer, want in zip(hits, loaded, buffers, expected, strict=True):
                        if not ok or (want is not None and bytes(buffer) != want):
                            errors.append(f"load of {key.chunk_hash.hex()} ok={ok}")
            except Exception as exc:
                errors.append(f"prefetch thread: {exc!r}")

        threads = [threading.Thread(target=store_controller), threading.Thread(target=prefetch_controller)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.wait_timeout_s * 4)
        assert not any(thread.is_alive() for thread in threads), "controller threads hung"
        assert errors == []
        assert self.client(adapter).lookup_and_lock(make_keys(32)).found == [True] * 32
        adapter.unlock(make_keys(32))
        self.assert_no_pins(adapter)

    def test_close_fails_or_finishes_pending_tasks(self, adapter: L2Adapter, pool: BufferPool) -> None:
        submitted: dict[int, tuple[L2Op, int]] = {}
        for batch in range(16):
            keys = make_keys(4, start=batch * 4)
            buffers = [pool.filled(pattern(batch * 4 + i, self.object_size)) for i in range(4)]
            submitted[adapter.submit_store(keys, buffers)] = (L2Op.STORE, 4)
            submitted[adapter.submit_lookup_and_lock(keys)] = (L2Op.LOOKUP, 4)
        adapter.close()
        adapter.close()
        after = adapter.submit_store(make_keys(1), [pool.filled(b"late")])
        submitted[after] = (L2Op.STORE, 1)
        results: dict[int, Any] = {**adapter.pop_completed_stores(), **adapter.pop_completed_lookups()}
        assert set(results) == set(submitted), "every task must be resolved once close() returns"
        for task_id, (op, count) in submitted.items():
            result = results[task_id]
            found = result.found if op is L2Op.LOOKUP else result
            assert len(found) == count
        assert results[after] == [False]

    def test_stats_are_integers(self, adapter: L2Adapter, pool: BufferPool) -> None:
        self.store(adapter, pool, make_keys(2))
        stats = adapter.stats()
        assert all(isinstance(name, str) and isinstance(value, int) for name, value in stats.items())

    # -- capabilities ----------------------------------------------------------------------

    @requires(PERSISTENCE)
    def test_objects_survive_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        keys = make_keys(3) + make_keys(1, salt="tenant-a")
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * 4
        reopened = reopen_adapter(adapter)
        assert set(reopened.iter_keys()) == set(keys)
        result = self.client(reopened).lookup_and_lock(keys)
        assert result.found == [True] * 4
        assert result.sizes == [len(d) for d in data]
        assert reopened.used_bytes() == sum(len(d) for d in data)
        by_salt = {"": sum(map(len, data[:3])), "tenant-a": len(data[3])}
        assert _nonzero(reopened.used_bytes_by_salt()) == by_salt
        loaded, contents = self.load(reopened, pool, keys, result.sizes)
        assert loaded == [True] * 4 and contents == data
        reopened.unlock(keys)

    @requires(PERSISTENCE)
    def test_usage_is_known_right_after_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        keys = make_keys(3) + make_keys(2, salt="tenant-a")
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * 5
        reopened = reopen_adapter(adapter)
        self.wait_scanned(reopened)
        # Before any lookup: the start-up scan accounted what the backend holds.
        assert reopened.used_bytes() == sum(len(d) for d in data)
        assert _nonzero(reopened.used_bytes_by_salt()) == {
            "": sum(map(len, data[:3])),
            "tenant-a": sum(map(len, data[3:])),
        }
        self._check_usage(reopened)
        assert reopened.delete(keys[:1]) == [True]
        assert reopened.used_bytes() == sum(len(d) for d in data[1:])

    @requires(PERSISTENCE)
    def test_deletes_survive_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        keys = make_keys(3)
        self.store(adapter, pool, keys)
        assert adapter.delete(keys[:2]) == [True, True]
        reopened = reopen_adapter(adapter)
        assert self.client(reopened).lookup_and_lock(keys).found == [False, False, True]
        reopened.unlock(keys[2:])

    def _fill(self, adapter: L2Adapter, pool: BufferPool) -> tuple[list[ObjectKey], ObjectKey]:
        """Store single objects until one does not fit; returns (stored, refused)."""
        client = self.client(adapter)
        stored: list[ObjectKey] = []
        for index in range(self.max_fill_objects):
            (key,) = make_keys(1, start=10_000 + index)
            if client.store([key], [pool.filled(pattern(index, self.object_size))]) == [False]:
                return stored, key
            stored.append(key)
        raise AssertionError(
            f"{self.max_fill_objects} objects of {self.object_size} bytes all fit; "
            "configure a smaller capacity for the capacity tests"
        )

    @requires(CAPACITY)
    def test_store_beyond_capacity_fails(self, adapter: L2Adapter, pool: BufferPool) -> None:
        stored, refused = self._fill(adapter, pool)
        assert stored, "not even one object fitted"
        assert 0.0 < adapter.usage() <= 1.0
        assert adapter.used_bytes() == self.object_size * len(stored)
        assert self.client(adapter).lookup_and_lock([refused]).found == [False]

    @requires(CAPACITY, EVICTION)
    def test_deleting_frees_capacity(self, adapter: L2Adapter, pool: BufferPool) -> None:
        stored, refused = self._fill(adapter, pool)
        before = adapter.usage()
        assert adapter.delete(stored[:2]) == [True, True]
        assert adapter.usage() < before
        data = pattern(77, self.object_size)
        assert self.client(adapter).store([refused], [pool.filled(data)]) == [True]
        result = self.client(adapter).lookup_and_lock([refused])
        loaded, contents = self.load(adapter, pool, [refused], result.sizes)
        assert loaded == [True] and contents == [data]
        adapter.unlock([refused])


def _nonzero(by_salt: dict[str, int]) -> dict[str, int]:
    return {salt: size for salt, size in by_salt.items() if size}
