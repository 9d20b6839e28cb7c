"""Conformance suite of L2 adapters.

An adapter plugin's tests subclass :class:`L2AdapterSuite`, name the component and
declare what it supports::

    class TestMock(L2AdapterSuite):
        component_name = "mock"
        capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, IMMEDIATE_MISSES, IMMEDIATE_HITS})

        def make_config(self) -> MockConfig:
            return MockConfig(max_size_gb=1 / 4096, namespace=uuid.uuid4().hex)

The default ``adapter`` fixture builds the component through the installed registry with
``make_config()`` and an :class:`~lmcache_tiers.l2.AdapterContext` whose ``l1_buffer`` is
the suite's ``l1_buffer`` fixture, the way the StorageManager does (the factory's backend
wrapped in core's adapter); every buffer the suite stores from or loads into is a slice
of it, so backends that need L1 buffers (NIXL) run the same tests.  Each starts on a page
(as L1 extents do) between guard pages of the same memory, checked after every load: a
load, even one that fails, must not write outside its buffer.  Override the ``adapter``
fixture (fresh and empty storage per test) when construction needs more, and
``reopen_adapter`` (a callable: close the given adapter, open a new one over the same
storage) when the default -- the same config again -- does not reach the same storage.
``serde`` is the chain the adapter applies (none by default); ``(DeflateSerde(),)`` runs
the suite on frames of other sizes than their objects'.

Everything goes through the non-blocking interface; results are awaited on the eventfds
with a generous timeout that only guards against hangs (no timing is asserted).
"""

from __future__ import annotations

import select
import threading
from typing import Any

import pytest

from lmcache_tiers.l2 import L2Adapter, L2Op
from lmcache_tiers.testing.l2_capabilities import L2CapabilityTests
from lmcache_tiers.testing.l2_damage import DamageTests
from lmcache_tiers.testing.l2_failures import BackendFailureTests
from lmcache_tiers.testing.l2_immediate import ImmediateLookupTests
from lmcache_tiers.testing.l2_integrity import IntegrityTests
from lmcache_tiers.testing.l2_support import (
    BACKEND_FAILURES,
    CAPACITY,
    DETECTS_DAMAGE,
    EVICTION,
    IMMEDIATE_HITS,
    IMMEDIATE_MISSES,
    PERSISTENCE,
    BufferPool,
    DeflateSerde,
    RecordingListener,
    Reopen,
    changes,
    make_keys,
    nonzero,
    pattern,
)

__all__ = [
    "BACKEND_FAILURES",
    "CAPACITY",
    "DETECTS_DAMAGE",
    "EVICTION",
    "IMMEDIATE_HITS",
    "IMMEDIATE_MISSES",
    "PERSISTENCE",
    "BufferPool",
    "DeflateSerde",
    "L2AdapterSuite",
    "RecordingListener",
    "Reopen",
    "make_keys",
    "pattern",
]


class L2AdapterSuite(
    L2CapabilityTests, ImmediateLookupTests, IntegrityTests, BackendFailureTests, DamageTests
):
    """Behaviour every L2 adapter must show through the non-blocking interface."""

    # -- the round trip --------------------------------------------------------------------

    def test_store_lookup_load_round_trip(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(4)
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * 4, f"stores of 4 keys answered {ok}{self.raised(adapter)}"
        found = self.client(adapter).lookup_and_lock(keys)
        assert found.found == [True] * 4, (
            f"a lookup of 4 keys just stored found {found.found}{self.raised(adapter)}"
        )
        assert found.sizes == [len(d) for d in data], (
            f"a lookup answered sizes {found.sizes} for objects of {[len(d) for d in data]} bytes"
        )
        loaded, contents = self.load(adapter, pool, keys, found.sizes)
        assert loaded == [True] * 4, (
            f"loads of 4 keys the lookup found answered {loaded}: a lookup must claim only"
            f" objects a load can deliver{self.raised(adapter)}"
        )
        assert contents == data, f"loads reported success with other bytes: {changes(contents, data)}"
        adapter.unlock(keys)
        self.assert_no_pins(adapter)

    def test_large_batches_round_trip(self, adapter: L2Adapter, pool: BufferPool) -> None:
        # A prompt's chunks come as one batch, larger than the other tests' batches: a
        # backend that pipelines, splits or caps batches must handle every key of one.
        sizes = [self.object_size // 16 + index for index in range(self.large_batch)]
        keys = make_keys(self._room_for(adapter, sizes), start=1000)
        sizes = sizes[: len(keys)]
        ok, data = self.store(adapter, pool, keys, sizes, seed=7)
        assert ok == [True] * len(keys)
        loaded, contents = self.lookup_and_load(adapter, pool, keys)
        assert loaded == [True] * len(keys), (
            f"loads of keys the lookup found failed: {[i for i, ok in enumerate(loaded) if not ok]}"
            f" of {len(keys)}{self.raised(adapter)}"
        )
        bad = [index for index, (got, want) in enumerate(zip(contents, data, strict=True)) if got != want]
        assert not bad, f"keys {bad} of a batch of {len(keys)} came back changed"
        assert adapter.delete(keys) == [True] * len(keys)
        found = self.client(adapter).lookup_and_lock(keys).found
        assert found == [False] * len(keys), f"a lookup found {sum(found)} of {len(keys)} keys deleted"
        assert adapter.used_bytes() == 0

    @staticmethod
    def _room_for(adapter: L2Adapter, sizes: list[int]) -> int:
        """How many of ``sizes``, from the first, the capacity ``adapter`` declares holds
        while empty: core refuses the keys past it, so a slot store configured with fewer
        slots than the large batch (or bytes) is not failed for the suite's demand."""
        declared = getattr(adapter, "capacity", None)
        limit = declared() if callable(declared) else None
        count = len(sizes)
        objects, room = getattr(limit, "objects", None), getattr(limit, "bytes", None)
        if objects is not None:
            count = min(count, objects)
        if room is not None:
            while count and sum(sizes[:count]) > room:
                count -= 1
        return count

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
        assert result.found == [True, False, True, True, False], (
            f"a lookup of 3 stored keys among 5 found {result.found}{self.raised(adapter)}"
        )
        assert result.sizes == [len(data[0]), 0, len(data[1]), len(data[2]), 0]
        sizes = [size or self.object_size for size in result.sizes]
        loaded, contents = self.load(adapter, pool, keys, sizes)
        assert loaded == [True, False, True, True, False], (
            f"loads of hits and misses answered {loaded}{self.raised(adapter)}"
        )
        hits = [contents[0], contents[2], contents[3]]
        assert hits == data, f"loads of the hits gave other bytes: {changes(hits, data)}"
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
        assert contents[1] == data[1], f"the load gave other bytes: {changes(contents[1:], data[1:])}"
        adapter.unlock(keys)

    def test_overwrite_replaces_object_and_accounting(self, adapter: L2Adapter, pool: BufferPool) -> None:
        (key,) = make_keys(1)
        self.store(adapter, pool, [key], [self.object_size], seed=1)
        ok, data = self.store(adapter, pool, [key], [self.object_size // 2], seed=2)
        assert ok == [True]
        result = self.client(adapter).lookup_and_lock([key])
        assert result.sizes == [self.object_size // 2]
        loaded, contents = self.load(adapter, pool, [key], result.sizes)
        assert loaded == [True], f"the load after an overwrite answered {loaded}"
        assert contents == data, f"the load after an overwrite gave other bytes: {changes(contents, data)}"
        adapter.unlock([key])
        assert adapter.used_bytes() == self.stored_bytes([key], data)

    # -- pins and delete ---------------------------------------------------------------------

    def test_pins_between_lookup_and_load_block_delete(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(2)
        _, data = self.store(adapter, pool, keys)
        result = self.client(adapter).lookup_and_lock([keys[0]])
        assert result.found == [True]
        assert adapter.delete(keys) == [False, True]
        loaded, contents = self.load(adapter, pool, [keys[0]], result.sizes)
        assert loaded == [True], f"the load of a key the lookup found and pinned answered {loaded}"
        assert contents == [data[0]], f"the load gave other bytes: {changes(contents, [data[0]])}"
        assert adapter.delete([keys[0]]) == [False], "a load must not consume the lookup's pin"
        adapter.unlock([keys[0]])
        assert adapter.delete([keys[0]]) == [True]
        found = self.client(adapter).lookup_and_lock(keys).found
        assert found == [False, False], f"a lookup of 2 keys deleted found {found}"
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
        self.store(adapter, pool, [keys[0], keys[2]], [self.object_size] * 2)
        assert adapter.delete(keys) == [True, False, True]
        assert adapter.delete(keys) == [False, False, False]
        found = self.client(adapter).lookup_and_lock(keys).found
        assert found == [False] * 3, f"a lookup of keys deleted or never stored found {found}"
        # Buffers of the deleted objects' size: only the delete can make these loads fail.
        loaded, _ = self.load(adapter, pool, keys, [self.object_size] * 3)
        assert loaded == [False] * 3, "a deleted object was still loaded"

    # -- accounting, salts, keys -----------------------------------------------------------

    def test_byte_accounting_total_and_by_salt(self, adapter: L2Adapter, pool: BufferPool) -> None:
        assert adapter.used_bytes() == 0
        plain = make_keys(2)
        salted = make_keys(3, salt="tenant-a")
        plain_sizes, salted_sizes = [1000, 2000], [300, 400, 500]
        ok, plain_data = self.store(adapter, pool, plain, plain_sizes)
        assert ok == [True] * 2
        ok, salted_data = self.store(adapter, pool, salted, salted_sizes, seed=1)
        assert ok == [True] * 3
        plain_bytes = self.stored_bytes(plain, plain_data)
        salted_bytes = self.stored_bytes(salted, salted_data)
        assert adapter.used_bytes() == plain_bytes + salted_bytes
        assert nonzero(adapter.used_bytes_by_salt()) == {"": plain_bytes, "tenant-a": salted_bytes}
        self._check_usage(adapter)
        # The only objects smaller than a page the suite stores: read them back too, or a
        # backend that packs, pads or inlines small objects wrongly would pass.
        loaded, contents = self.lookup_and_load(adapter, pool, plain + salted)
        assert loaded == [True] * 5
        assert contents == plain_data + salted_data, (
            f"an object smaller than a page came back changed: {changes(contents, plain_data + salted_data)}"
        )
        assert adapter.delete([plain[0], salted[2]]) == [True, True]
        plain_bytes = self.stored_bytes(plain[1:], plain_data[1:])
        salted_bytes = self.stored_bytes(salted[:2], salted_data[:2])
        assert adapter.used_bytes() == plain_bytes + salted_bytes
        assert nonzero(adapter.used_bytes_by_salt()) == {"": plain_bytes, "tenant-a": salted_bytes}
        adapter.delete(plain + salted)
        assert adapter.used_bytes() == 0
        assert nonzero(adapter.used_bytes_by_salt()) == {}

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
        load_buffers = [pool.take(10)]
        ids = [
            adapter.submit_store(keys, [pool.filled(b"a" * 10)]),
            adapter.submit_lookup_and_lock(keys),
            adapter.submit_load(keys, load_buffers),
            adapter.submit_store(keys, [pool.filled(b"b" * 10)]),
        ]
        assert len(set(ids)) == len(ids)
        client = self.client(adapter)
        for op, task_id in zip([L2Op.STORE, L2Op.LOOKUP, L2Op.LOAD, L2Op.STORE], ids, strict=True):
            client.wait(op, task_id)
        pool.assert_guards_intact(keys, load_buffers)
        adapter.unlock(keys * 2)

    def test_concurrent_submits_from_two_threads(self, adapter: L2Adapter, pool: BufferPool) -> None:
        client = self.client(adapter)
        chunk = self.object_size // 4
        errors: list[str] = []
        done = threading.Event()

        def data_of(index: int) -> bytes:
            return pattern(1000 + index, chunk)

        def store_controller() -> None:
            try:
                for batch in range(8):
                    keys = make_keys(4, start=batch * 4)
                    ok = client.store(keys, [pool.filled(data_of(batch * 4 + i)) for i in range(4)])
                    if ok != [True] * 4:
                        errors.append(f"store batch {batch} -> {ok}")
            except Exception as exc:
                errors.append(f"store thread: {exc!r}")
            finally:
                done.set()

        # The prefetch thread may run many rounds while the stores go on; it reuses the
        # same buffers so a fast loop cannot exhaust the suite's L1 buffer.
        scratch = [pool.take(chunk) for _ in range(32)]
        zeros = bytes(chunk)

        def prefetch_controller() -> None:
            try:
                rounds = 0
                while not done.is_set() or rounds < 2:
                    rounds += 1 if done.is_set() else 0
                    keys = make_keys(32)
                    result = client.lookup_and_lock(keys)
                    hits = [k for k, hit in zip(keys, result.found, strict=True) if hit]
                    # Each key is stored once, with bytes known from its index: a load
                    # racing the store that acknowledges it is checked as strictly.
                    expected = [data_of(i) for i, hit in enumerate(result.found) if hit]
                    sizes = [s for s in result.sizes if s]
                    if any(size != chunk for size in sizes):
                        errors.append(f"lookup sizes {sizes}, every object stored was {chunk} bytes")
                    buffers = scratch[: len(sizes)]
                    # Cleared, or a load that reported success without copying would leave
                    # the previous round's bytes of the same key there and pass the check.
                    for buffer in buffers:
                        buffer[:] = zeros
                    loaded = client.load(hits, buffers)
                    adapter.unlock(hits)
                    errors.extend(pool.guard_damages(hits, buffers))
                    for key, ok, buffer, want in zip(hits, loaded, buffers, expected, strict=True):
                        if not ok or bytes(buffer) != want:
                            errors.append(f"load of {key.chunk_hash.hex()} ok={ok}")
            except Exception as exc:
                errors.append(f"prefetch thread: {exc!r}")

        threads = [threading.Thread(target=store_controller), threading.Thread(target=prefetch_controller)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.wait_timeout_s * 4)
        assert not any(thread.is_alive() for thread in threads), "controller threads hung"
        assert errors == [], errors
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
