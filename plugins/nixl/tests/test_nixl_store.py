"""nixl_store on real NIXL POSIX: pool exhaustion, slot reuse, eviction around pins."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from lmcache_plugin_nixl.pool import slot_file_name
from lmcache_plugin_nixl.slots import Claim, SlotTable
from nixl_helpers import (
    Arena,
    HeldCall,
    call_held_in_transfer,
    client,
    lru_eviction_controller,
    open_pool,
    pool_config,
    scratch_dir,
    still_open,
)

from lmcache_tiers.config import FieldError
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10


def test_full_pool_reports_unwritten_keys_and_counts_them() -> None:
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            keys = make_keys(6)
            data = [pattern(i, SIZE) for i in range(6)]
            ok = client(adapter).store(keys, [arena.filled(d) for d in data])
            assert ok == [True] * 4 + [False] * 2
            assert adapter.stats()["capacity_refusals"] == 2, "the pool holds 4 objects"
            assert adapter.usage() == 1.0
            # The refused keys are not there; the stored ones load their own bytes.
            result = client(adapter).lookup_and_lock(keys)
            assert result.found == [True] * 4 + [False] * 2
            buffers = [arena.take(SIZE) for _ in range(4)]
            assert client(adapter).load(keys[:4], buffers) == [True] * 4
            assert [bytes(b) for b in buffers] == data[:4]
            adapter.unlock(keys[:4])
            # A later batch is refused too, and counted again.
            assert client(adapter).store(keys[4:], [arena.filled(d) for d in data[4:]]) == [False, False]
            assert adapter.stats()["capacity_refusals"] == 4
        finally:
            adapter.close()


def test_delete_frees_slots_for_new_keys() -> None:
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=2), arena.view)
        try:
            keys = make_keys(3)
            data = [pattern(10 + i, SIZE - i) for i in range(3)]
            assert client(adapter).store(keys[:2], [arena.filled(d) for d in data[:2]]) == [True, True]
            assert client(adapter).store(keys[2:], [arena.filled(data[2])]) == [False]
            assert adapter.delete([keys[0]]) == [True]
            assert adapter.usage() == 0.5
            assert client(adapter).store(keys[2:], [arena.filled(data[2])]) == [True]
            result = client(adapter).lookup_and_lock(keys)
            assert result.found == [False, True, True]
            buffers = [arena.take(len(d)) for d in data[1:]]
            assert client(adapter).load(keys[1:], buffers) == [True, True]
            assert [bytes(b) for b in buffers] == data[1:]
            adapter.unlock(keys[1:])
        finally:
            adapter.close()


def test_eviction_skips_pinned_keys_and_takes_them_next_cycle() -> None:
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            controller = lru_eviction_controller(adapter, watermark=0.75, ratio=0.5)
            keys = make_keys(4)
            assert (
                client(adapter).store(keys, [arena.filled(pattern(i, SIZE)) for i in range(4)]) == [True] * 4
            )
            # LRU evicts the tail of a prefix first; an in-flight prefetch has pinned it.
            assert client(adapter).lookup_and_lock(keys[2:]).found == [True, True]
            controller.evict(2 * SIZE)
            assert set(adapter.iter_keys()) == set(keys[2:]), "pinned keys skipped, the others evicted"
            assert adapter.usage() == 0.5
            # The load completes and drops its pins; the next cycle takes them.
            buffers = [arena.take(SIZE) for _ in range(2)]
            assert client(adapter).load(keys[2:], buffers) == [True, True]
            adapter.unlock(keys[2:])
            controller.evict(2 * SIZE)
            assert list(adapter.iter_keys()) == []
            assert adapter.usage() == 0.0
        finally:
            adapter.close()


def test_buffers_outside_the_registered_arena_round_trip() -> None:
    # Serde output and callers without an L1 hand over ordinary bytes: registered per batch.
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena=None)
        try:
            keys = make_keys(2)
            data = [pattern(1, 5000), pattern(2, 7)]
            assert client(adapter).store(keys, [memoryview(d) for d in data]) == [True, True]
            buffers = [memoryview(bytearray(len(d))) for d in data]
            assert client(adapter).load(keys, buffers) == [True, True]
            assert [bytes(b) for b in buffers] == data
        finally:
            adapter.close()


@pytest.mark.parametrize("size", [SIZE, SIZE + 123])
def test_direct_io_round_trip_aligned_and_unaligned(size: int) -> None:
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=2, direct_io=True), arena.view)
        try:
            keys = make_keys(2)
            data = [pattern(5, size), pattern(6, size // 2)]
            assert client(adapter).store(keys, [arena.filled(d) for d in data]) == [True, True]
            buffers = [arena.take(len(d)) for d in data]
            assert client(adapter).load(keys, buffers) == [True, True]
            assert [bytes(b) for b in buffers] == data
        finally:
            adapter.close()


def test_slot_files_are_preallocated_truncated_and_removed() -> None:
    with scratch_dir() as directory:
        stale = os.path.join(directory, slot_file_name(0))
        with open(stale, "wb") as handle:
            handle.write(b"left by an earlier server")
        adapter = open_pool(pool_config(directory, pool_size=3))
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".bin"))
            assert names == [slot_file_name(i) for i in range(3)]
            assert os.path.getsize(stale) == 0
            assert client(adapter).lookup_and_lock(make_keys(1)).found == [False]
        finally:
            adapter.close()
        assert os.listdir(directory) == []


def test_slot_files_beyond_the_pool_left_by_a_larger_crashed_pool_are_removed() -> None:
    """A server killed with a larger pool leaves slot files this pool does not truncate
    or remove at close: they would hold its old objects' bytes on disk for good."""
    with scratch_dir() as directory:
        for slot in (3, 7):
            with open(os.path.join(directory, slot_file_name(slot)), "wb") as handle:
                handle.write(b"left by a killed server with a larger pool")
        with open(os.path.join(directory, "unrelated.bin"), "wb") as handle:
            handle.write(b"not a slot file")
        adapter = open_pool(pool_config(directory, pool_size=3))
        try:
            names = sorted(n for n in os.listdir(directory) if n.startswith("nixl-pool-"))
            assert names == [slot_file_name(i) for i in range(3)]
        finally:
            adapter.close()
        assert os.listdir(directory) == ["unrelated.bin"]


def test_a_smaller_object_does_not_leave_the_old_tail_on_disk() -> None:
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=1))
        try:
            (key,) = make_keys(1)
            assert client(adapter).store([key], [memoryview(pattern(1, SIZE))]) == [True]
            assert client(adapter).store([key], [memoryview(pattern(2, 100))]) == [False], (
                "pool of one is full"
            )
            assert adapter.delete([key]) == [True]
            assert client(adapter).store([key], [memoryview(pattern(2, 100))]) == [True]
            assert os.path.getsize(os.path.join(directory, slot_file_name(0))) == 100
        finally:
            adapter.close()


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past ``limit`` bytes of a file fail (EFBIG) or complete short, as on a full
    disk; the signal such a write raises is ignored, so the write just fails."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_write_that_failed_part_way_leaves_no_tail_under_the_next_object() -> None:
    """A store whose write NIXL reports failed after part of it reached the slot file
    leaves those bytes there; the next, smaller object stored in that slot truncates the
    file to itself all the same (the slot file holds no bytes but its object's)."""
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=1))
        slot_path = os.path.join(directory, slot_file_name(0))
        try:
            keys = make_keys(2)
            with file_size_limit(SIZE // 2):
                assert client(adapter).store(keys[:1], [memoryview(pattern(1, SIZE))]) == [False]
            assert os.path.getsize(slot_path) == SIZE // 2, "the failed write's first half is on disk"
            small = pattern(2, 100)
            assert client(adapter).store(keys[1:], [memoryview(small)]) == [True]
            assert os.path.getsize(slot_path) == 100
            buffer = bytearray(100)
            assert client(adapter).lookup_and_lock(keys[1:]).found == [True]
            assert client(adapter).load(keys[1:], [memoryview(buffer)]) == [True]
            assert bytes(buffer) == small
            adapter.unlock(keys[1:])
        finally:
            adapter.close()


def test_a_slot_whose_bytes_changed_on_disk_is_a_counted_miss_and_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bytes that changed in a slot file after the store (a bad disk, a stray writer) are
    never handed out: the load fails that key alone, the key is dropped from the pool (its
    slot goes back once its reader left), and the drop is counted and logged."""
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=2), arena.view)
        try:
            keys = make_keys(2)
            data = [pattern(30 + i, SIZE) for i in range(2)]
            assert client(adapter).store(keys, [arena.filled(d) for d in data]) == [True, True]
            with open(os.path.join(directory, slot_file_name(0)), "r+b") as slot_file:
                slot_file.seek(SIZE // 2)
                slot_file.write(b"rot!")
            assert client(adapter).lookup_and_lock(keys).found == [True, True]
            buffers = [arena.take(SIZE) for _ in keys]
            with caplog.at_level("WARNING"):
                assert client(adapter).load(keys, buffers) == [False, True]
            assert bytes(buffers[1]) == data[1], "the intact slot of the batch still loads"
            adapter.unlock(keys)
            assert adapter.stats()["corrupt_slots_dropped"] == 1
            assert "checksum" in caplog.text
            assert client(adapter).lookup_and_lock(keys).found == [False, True]
            adapter.unlock(keys[1:])
            assert adapter.stats()["pool_slots_used"] == 1, "the damaged slot is free again"
        finally:
            adapter.close()


def test_a_slot_that_cannot_be_finished_is_given_back_and_counted(monkeypatch) -> None:
    """A failure finishing one slot (its file's truncation) fails that key alone: every
    other key of the batch is stored, and the key can be stored again later."""
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4))
        try:
            keys = make_keys(3)
            data = [pattern(20 + i, SIZE) for i in range(3)]
            storage = adapter.backend._storage
            finish = storage.written
            failing = iter([False, True])

            def written(slot: int, length: int) -> None:
                if next(failing, False):
                    raise OSError(28, "No space left on device")
                finish(slot, length)

            monkeypatch.setattr(storage, "written", written)
            assert client(adapter).store(keys, [memoryview(d) for d in data]) == [True, False, True]
            assert adapter.stats()["slot_finish_failures"] == 1
            assert client(adapter).store(keys[1:2], [memoryview(data[1])]) == [True]
            buffers = [bytearray(SIZE) for _ in keys]
            assert client(adapter).lookup_and_lock(keys).found == [True] * 3
            assert client(adapter).load(keys, [memoryview(b) for b in buffers]) == [True] * 3
            assert [bytes(b) for b in buffers] == data
            adapter.unlock(keys)
        finally:
            adapter.close()


def test_stores_given_no_slot_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A key repeated in a batch (the first occurrence still writing) and a key whose
    replacement finds every slot taken (its old slot held by a load) are reported not
    stored: each counted, and each explained in the log."""
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=2))
        try:
            (key,) = make_keys(1)
            assert client(adapter).store([key], [memoryview(pattern(1, SIZE))]) == [True]
            slots = adapter.backend._slots
            reading = slots.acquire_for_read([key])  # a load of the key, in flight
            try:
                again = memoryview(pattern(2, SIZE))
                assert client(adapter).store([key, key], [again, again]) == [True, False]
                assert client(adapter).store([key], [again]) == [False]
            finally:
                slots.release_reads([entry.slot for entry in reading if entry is not None])
            stats = adapter.stats()
            assert stats["store_busy_skips"] == 1 and stats["pool_full_rejections"] == 1
            assert "another store of the same key is still writing it" in caplog.text
            assert "no free slot" in caplog.text
        finally:
            adapter.close()


def _signal_on_return(monkeypatch, owner: object, name: str, returned: threading.Event) -> None:
    """``owner.name`` sets ``returned`` whenever a call of it returns or raises."""
    method = getattr(owner, name)

    def watched(*args: object, **kwargs: object) -> object:
        try:
            return method(*args, **kwargs)
        finally:
            returned.set()

    monkeypatch.setattr(owner, name, watched)


def _close_after_the_stall(
    monkeypatch, backend: object, gate: threading.Event, returned: threading.Event
) -> None:
    """The backend's close -- which core runs once it gave the stalled call up -- first
    lets the stalled batch return (``gate``) and waits until the call did (``returned``):
    what the call does then, it does while the adapter is closing."""
    close = backend.close  # type: ignore[attr-defined]

    def slow_close() -> None:
        gate.set()
        assert returned.wait(30)
        close()

    monkeypatch.setattr(backend, "close", slow_close)


def test_a_failed_load_batch_is_not_retried_into_l1_once_closing_began(monkeypatch) -> None:
    """A batch that fails is retried item by item -- but not once the adapter started
    closing: core fails a load still running at its close deadline and gives its buffers
    to other objects before it closes the backend, so a retry would read slot bytes into
    another object's L1 memory."""
    from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError

    arena = Arena()
    entered, gate, finished = threading.Event(), threading.Event(), threading.Event()
    reads_while_closing: list[int] = []
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            keys = make_keys(2)
            data = [pattern(30 + i, SIZE) for i in range(2)]
            assert client(adapter).store(keys, [arena.filled(d) for d in data]) == [True, True]
            backend = adapter.backend
            _signal_on_return(monkeypatch, backend._transfer, "run", finished)
            runtime = NixlRuntime.shared()
            transfer_many = runtime.transfer_many

            def failing_transfer(
                backend_name: str, operation: str, *args: object, **kwargs: object
            ) -> object:
                if operation == "READ":
                    if adapter.state.closing.is_set():
                        reads_while_closing.append(1)
                    if not entered.is_set():
                        entered.set()
                        gate.wait(60)
                        raise NixlTransferError("injected: the batch failed after a long stall")
                return transfer_many(backend_name, operation, *args, **kwargs)

            monkeypatch.setattr(runtime, "transfer_many", failing_transfer)
            _close_after_the_stall(monkeypatch, backend, gate, finished)
            assert client(adapter).lookup_and_lock(keys).found == [True, True]
            adapter.submit_load(keys, [arena.take(SIZE) for _ in keys])
            assert entered.wait(10)
            adapter.close_timeout_s = 0.2
            adapter.close()
            assert finished.is_set()
            assert reads_while_closing == [], "items were read into L1 after closing began"
        finally:
            gate.set()
            adapter.close()


@pytest.mark.parametrize("stalled_batch", ["fails", "succeeds"])
def test_a_store_stuck_past_close_writes_and_publishes_nothing_more(monkeypatch, stalled_batch: str) -> None:
    """A store whose write-back batch is stuck in storage (a hung mount) when core's close
    deadline passes: core fails it and hands its payload buffers back before it closes the
    backend.  Once the batch returns, the store must post no further NIXL write from those
    buffers (a failed batch is retried item by item otherwise), finish no slot file (its
    descriptor is closed with the pool, maybe reused) and publish no slot."""
    from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError

    arena = Arena()
    entered, gate, finished = threading.Event(), threading.Event(), threading.Event()
    writes_while_closing: list[int] = []
    finished_while_closing: list[int] = []
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            keys = make_keys(2)
            backend = adapter.backend
            closing = adapter.state.closing
            _signal_on_return(monkeypatch, backend, "put_many", finished)
            runtime = NixlRuntime.shared()
            transfer_many = runtime.transfer_many

            def stuck_transfer(backend_name: str, operation: str, *args: object, **kwargs: object) -> object:
                if operation == "WRITE":
                    if not entered.is_set():
                        entered.set()
                        gate.wait(60)
                        if stalled_batch == "fails":
                            raise NixlTransferError("injected: the batch failed after a long stall")
                    elif closing.is_set():
                        writes_while_closing.append(1)
                return transfer_many(backend_name, operation, *args, **kwargs)

            monkeypatch.setattr(runtime, "transfer_many", stuck_transfer)
            storage = backend._storage
            written = storage.written

            def watched_written(slot: int, length: int) -> None:
                if closing.is_set():
                    finished_while_closing.append(slot)
                written(slot, length)

            monkeypatch.setattr(storage, "written", watched_written)
            _close_after_the_stall(monkeypatch, backend, gate, finished)
            buffers = [arena.take(SIZE) for _ in keys]
            for index, buffer in enumerate(buffers):
                buffer[:] = pattern(40 + index, SIZE)
            adapter.submit_store(keys, buffers)
            assert entered.wait(10)
            adapter.close_timeout_s = 0.2
            adapter.close()
            assert finished.is_set()
            assert writes_while_closing == [], "a store posted NIXL writes after closing began"
            assert finished_while_closing == [], "a store finished slot files after closing began"
            assert backend._slots.used_slots == 0, "a store published slots after closing began"
        finally:
            gate.set()
            adapter.close()


# -- slot bookkeeping ------------------------------------------------------------------------


def test_slot_table_claims_until_full() -> None:
    table = SlotTable(2)
    keys = make_keys(3)
    claims = table.claim(keys)
    assert sorted(c for c in claims if isinstance(c, int)) == [0, 1]
    assert claims[2] is Claim.FULL
    assert table.claim(keys[:1]) == [Claim.BUSY], "a key being written is not written twice"
    first = claims[0]
    assert isinstance(first, int)
    table.abandon(keys[0], first)
    assert table.sizes(keys) == [None, None, None]
    assert table.used_slots == 1


def test_slot_with_a_reader_is_never_reused() -> None:
    table = SlotTable(2)
    (key,) = make_keys(1)
    (slot,) = table.claim([key])
    assert isinstance(slot, int)
    table.publish(key, slot, 10, b"digest-1")
    (entry,) = table.acquire_for_read([key])
    assert entry is not None
    assert table.delete([key]) == [False], "a delete racing a load is refused"
    # Rewriting the key moves it to a new slot; the old one waits for its reader.
    (new_slot,) = table.claim([key])
    assert isinstance(new_slot, int) and new_slot != slot
    table.publish(key, new_slot, 20, b"digest-2")
    assert table.used_slots == 2
    assert table.claim(make_keys(1, start=5)) == [Claim.FULL]
    table.release_reads([entry.slot])
    assert table.used_slots == 1
    assert table.sizes([key]) == [20]
    assert table.delete([key]) == [True]
    assert table.used_slots == 0


def test_a_store_whose_write_failed_in_storage_is_not_counted_as_stopped_by_the_close(monkeypatch) -> None:
    """``store_stopped_closing`` counts keys the close cost: a key whose write the storage
    failed (a one-key batch is not retried) failed on its own, closing or not, and is no
    key stopped by the close."""
    from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError

    arena = Arena()
    entered, gate, finished = threading.Event(), threading.Event(), threading.Event()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            backend = adapter.backend
            _signal_on_return(monkeypatch, backend, "put_many", finished)
            runtime = NixlRuntime.shared()

            def failing_transfer(
                backend_name: str, operation: str, *args: object, **kwargs: object
            ) -> object:
                entered.set()
                gate.wait(60)
                raise NixlTransferError("injected: the device failed the write")

            monkeypatch.setattr(runtime, "transfer_many", failing_transfer)
            _close_after_the_stall(monkeypatch, backend, gate, finished)
            buffer = arena.take(SIZE)
            buffer[:] = pattern(50, SIZE)
            adapter.submit_store(make_keys(1), [buffer])
            assert entered.wait(10)
            adapter.close_timeout_s = 0.2
            adapter.close()
            assert finished.is_set()
            assert adapter.stats().get("store_stopped_closing", 0) == 0
            assert backend._slots.used_slots == 0
        finally:
            gate.set()
            adapter.close()


def test_a_store_past_its_closing_check_finishes_its_slots_before_close_closes_their_files(
    monkeypatch,
) -> None:
    """Between a store's closing check and its last slot published, the backend's close
    (core runs it once its deadline passed) must not close the slot files: finishing a
    slot truncates its file through a descriptor that may name another file by then.  The
    store holds the slot files open until it leaves: close leaves their closing to it."""
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4))
        try:
            keys = make_keys(2)
            backend = adapter.backend
            storage = backend._storage
            finish = storage.written
            closer: list[threading.Thread] = []
            closed = threading.Event()
            finished_after_close: list[int] = []

            def close_backend() -> None:
                backend.close()
                closed.set()

            def written(slot: int, length: int) -> None:
                if not closer:
                    # The store passed its closing check: now the adapter closes.
                    adapter.state.closing.set()
                    closer.append(threading.Thread(target=close_backend))
                    closer[0].start()
                    closed.wait(1.0)  # returns at once when close does not wait for the store
                if not storage._buffered:
                    finished_after_close.append(slot)
                finish(slot, length)

            monkeypatch.setattr(storage, "written", written)
            data = [memoryview(pattern(60 + i, SIZE)) for i in range(2)]
            assert backend.put_many(keys, data) == [True, True]
            closer[0].join(30)
            assert closed.is_set()
            assert finished_after_close == [], "slots were finished after close closed their files"
        finally:
            adapter.close()


def test_close_does_not_wait_for_a_store_stuck_finishing_its_slots(monkeypatch) -> None:
    """Finishing a slot truncates its file, which can hang on a hung device.  The backend's
    close -- core's last step once its deadline passed -- must not wait for such a store;
    the slot files are closed once the store's finishing returns, not under it."""
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4))
        try:
            backend = adapter.backend
            storage = backend._storage
            finish = storage.written
            entered, gate, closed = threading.Event(), threading.Event(), threading.Event()
            open_while_finishing: list[bool] = []

            def stuck_written(slot: int, length: int) -> None:
                entered.set()
                gate.wait(60)
                open_while_finishing.append(bool(storage._buffered))
                finish(slot, length)

            monkeypatch.setattr(storage, "written", stuck_written)
            keys = make_keys(1)
            store = threading.Thread(target=backend.put_many, args=(keys, [memoryview(pattern(70, SIZE))]))
            store.start()
            assert entered.wait(10)
            adapter.state.closing.set()

            def close_backend() -> None:
                backend.close()
                closed.set()

            closer = threading.Thread(target=close_backend)
            closer.start()
            try:
                assert closed.wait(10), "close waited for a store stuck finishing a slot file"
            finally:
                gate.set()
                store.join(30)
                closer.join(30)
            assert open_while_finishing == [True], "the slot files were closed under a finishing store"
            assert storage._buffered == [], "the slot files were not closed after the store finished"
        finally:
            gate.set()
            adapter.close()


def test_a_load_cut_short_by_the_close_is_counted_and_logged(
    monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A load whose transfer returns once the adapter is closing reports misses (its
    buffers may be other objects' by now): those keys are counted as
    ``load_stopped_closing`` and explained in a log line."""
    from lmcache_plugin_nixl.runtime import NixlRuntime

    arena = Arena()
    entered, gate, finished = threading.Event(), threading.Event(), threading.Event()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            keys = make_keys(2)
            data = [pattern(80 + i, SIZE) for i in range(2)]
            assert client(adapter).store(keys, [arena.filled(d) for d in data]) == [True, True]
            backend = adapter.backend
            _signal_on_return(monkeypatch, backend, "get_many_into", finished)
            runtime = NixlRuntime.shared()
            transfer_many = runtime.transfer_many

            def stalled_transfer(
                backend_name: str, operation: str, *args: object, **kwargs: object
            ) -> object:
                if operation == "READ" and not entered.is_set():
                    entered.set()
                    gate.wait(60)
                return transfer_many(backend_name, operation, *args, **kwargs)

            monkeypatch.setattr(runtime, "transfer_many", stalled_transfer)
            _close_after_the_stall(monkeypatch, backend, gate, finished)
            assert client(adapter).lookup_and_lock(keys).found == [True, True]
            adapter.submit_load(keys, [arena.take(SIZE) for _ in keys])
            assert entered.wait(10)
            adapter.close_timeout_s = 0.2
            with caplog.at_level("INFO"):
                adapter.close()
            assert finished.is_set()
            assert adapter.stats().get("load_stopped_closing", 0) == 2
            assert any("not loaded: the adapter is closing" in r.getMessage() for r in caplog.records)
        finally:
            gate.set()
            adapter.close()


def test_the_slot_files_are_closed_once_when_close_meets_the_last_finishing_store(monkeypatch) -> None:
    """A close called while the last store finishing its slots closes the slot files (a
    second close, from another thread) must not close them again: closing a descriptor
    number twice can close another file that reused it, or fail the close with EBADF."""
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4))
        try:
            backend = adapter.backend
            storage = backend._storage
            finish, close_files = storage.written, storage.close
            entered, gate = threading.Event(), threading.Event()
            closing_files, second_close_done = threading.Event(), threading.Event()
            closes: list[str] = []

            def stuck_written(slot: int, length: int) -> None:
                entered.set()
                gate.wait(60)
                finish(slot, length)

            def counted_close() -> None:
                closes.append(threading.current_thread().name)
                if threading.current_thread().name == "store":
                    # The last finishing store is closing the files: a second close now.
                    closing_files.set()
                    second_close_done.wait(10)
                close_files()

            monkeypatch.setattr(storage, "written", stuck_written)
            monkeypatch.setattr(storage, "close", counted_close)
            store = threading.Thread(
                target=backend.put_many, args=(make_keys(1), [memoryview(pattern(71, SIZE))]), name="store"
            )
            store.start()
            assert entered.wait(10)
            adapter.state.closing.set()
            backend.close()
            gate.set()
            assert closing_files.wait(10)
            second = threading.Thread(target=backend.close, name="second-close")
            second.start()
            second.join(10)
            second_close_done.set()
            store.join(30)
            assert closes == ["store"], f"the slot files were closed by {closes}"
            assert storage._buffered == []
        finally:
            gate.set()
            second_close_done.set()
            adapter.close()


# -- the slot files outlive every call still using them ---------------------------------------


def _slot_file_identities(storage: object) -> list[tuple[int, int]]:
    """(descriptor, inode) of every open slot file."""
    fds = list(storage._buffered) + list(storage._direct)  # type: ignore[attr-defined]
    return [(fd, os.fstat(fd).st_ino) for fd in fds]


def _held_pool(monkeypatch, operation: str, **options: Any) -> AbstractContextManager[HeldCall]:
    """A pool of 4 slot files over an L1 arena with a store or load held in its transfer."""
    return call_held_in_transfer(
        monkeypatch,
        operation,
        lambda directory, arena: open_pool(pool_config(directory, pool_size=4), arena),
        **options,
    )


@pytest.mark.parametrize("operation", ["WRITE", "READ"])
def test_close_leaves_the_slot_files_open_under_a_transfer_in_progress(monkeypatch, operation: str) -> None:
    """NIXL posts a request by descriptor number: a store or load inside its transfer when
    the backend's close runs (core's last step once its deadline passed) must find the
    slot files still open, else a number another file reused would be written or read.
    Close does not wait for the call; the call closes the files when it leaves."""
    identities: list[tuple[int, int]] = []

    def note_slot_files(backend: object) -> None:
        identities.extend(_slot_file_identities(backend._storage))  # type: ignore[attr-defined]

    with _held_pool(monkeypatch, operation, count=2, before_call=note_slot_files) as held:
        held.close_under_it()
        open_under_transfer = still_open(identities)
        held.let_it_leave()
        assert open_under_transfer, "close closed the slot files under a transfer in progress"
        assert held.backend._storage._buffered == [], "the call did not close the slot files when it left"
        assert not any(name.startswith("nixl-pool-") for name in os.listdir(held.directory))


@pytest.mark.parametrize("operation", ["WRITE", "READ"])
def test_a_call_raising_inside_its_transfer_after_close_still_closes_the_slot_files(
    monkeypatch, operation: str
) -> None:
    """Whoever leaves last closes the slot files, also a call whose transfer raised."""
    with _held_pool(monkeypatch, operation, seed=95, then_raise=True) as held:
        storage = held.backend._storage
        held.close_under_it()
        assert storage._buffered, "close closed the slot files under a transfer in progress"
        held.let_it_leave()
        assert len(held.raised) == 1
        assert storage._buffered == []
        assert held.backend._slots.used_slots == (1 if operation == "READ" else 0)


def test_calls_after_close_are_refused_counted_and_touch_no_file(caplog: pytest.LogCaptureFixture) -> None:
    """Once the backend's close ran, a store or load posts nothing (its descriptors are
    closed): its keys fail, counted as stopped by the close, one log line each."""
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            backend = adapter.backend
            keys = make_keys(3)
            assert backend.put_many(keys[:2], [memoryview(pattern(96 + i, SIZE)) for i in range(2)]) == [
                True,
                True,
            ]
            adapter.state.closing.set()
            backend.close()
            with caplog.at_level("INFO"):
                assert backend.put_many(keys[2:], [memoryview(pattern(99, SIZE))]) == [False]
                assert backend.get_many_into(keys[:2], [arena.take(SIZE) for _ in range(2)]) == [False, False]
            stats = adapter.stats()
            assert stats.get("store_stopped_closing", 0) == 1
            assert stats.get("load_stopped_closing", 0) == 2
            assert backend._slots.used_slots == 2, "a refused store claimed a slot for good"
            assert any("not stored: the adapter is closing" in r.getMessage() for r in caplog.records)
            assert any("not loaded: the adapter is closing" in r.getMessage() for r in caplog.records)
        finally:
            adapter.close()


def test_a_second_close_under_a_transfer_in_progress_closes_nothing(monkeypatch) -> None:
    """Two closes while a store is inside its transfer: neither closes the slot files under
    it, and the store closes them once when it leaves."""
    closes: list[str] = []
    identities: list[tuple[int, int]] = []

    def count_closes(backend: object) -> None:
        storage = backend._storage  # type: ignore[attr-defined]
        close_files = storage.close
        identities.extend(_slot_file_identities(storage))

        def counted_close() -> int:
            closes.append(threading.current_thread().name)
            return close_files()

        monkeypatch.setattr(storage, "close", counted_close)

    with _held_pool(monkeypatch, "WRITE", seed=97, before_call=count_closes) as held:
        held.close_under_it()
        held.backend.close()
        open_under_transfer = still_open(identities)
        held.let_it_leave()
        assert open_under_transfer
        assert closes == ["store"], f"the slot files were closed by {closes}"


def test_closing_the_slot_files_goes_on_past_a_descriptor_that_fails_to_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One descriptor whose close fails must not leave the other slot files open, their
    files in place and the directory locked: the rest are closed, the failure counted
    and logged."""
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4))
        storage = adapter.backend._storage
        real = storage._buffered[1]
        # A number no file can have (far above the open-file limit): its close fails (EBADF).
        storage._buffered[1] = 1 << 30
        others = [(fd, os.fstat(fd).st_ino) for fd in storage._buffered if fd != 1 << 30]
        try:
            with caplog.at_level("WARNING"):
                adapter.close()
            assert adapter.stats().get("slot_file_close_failures", 0) == 1
            assert any("could not be closed" in r.getMessage() for r in caplog.records)
            assert not any(still_open([identity]) for identity in others)
            assert not any(name.startswith("nixl-pool-") for name in os.listdir(directory))
            reopened = open_pool(pool_config(directory, pool_size=4))
            reopened.close()
        finally:
            os.close(real)


@pytest.mark.parametrize("operation", ["WRITE", "READ"])
def test_close_keeps_the_l1_arena_registered_under_a_transfer_in_progress(
    monkeypatch, operation: str
) -> None:
    """A NIXL request posted into the L1 arena names memory NIXL holds registered: the
    backend's close must not deregister the arena under a store or load still inside its
    transfer (the request's handle would outlive the registration it was built on).  The
    last call to leave releases it, with the slot files."""
    with _held_pool(monkeypatch, operation, seed=93) as held:
        host = held.backend._host
        assert host._arena_registration is not None
        held.close_under_it()
        registered_under_transfer = host._arena_registration is not None
        held.let_it_leave()
        assert registered_under_transfer, "close deregistered the L1 arena under a transfer in progress"
        assert host._arena_registration is None, "the last call did not deregister the L1 arena"
        assert held.backend._storage._buffered == []


def test_a_removed_directory_leaves_the_pool_serving_from_its_open_slot_files() -> None:
    # The slot files stay open for the pool's life: their names going does not lose what
    # they hold, later stores land in them too, and nothing is created again at the path.
    arena = Arena()
    with scratch_dir() as outer:
        directory = os.path.join(outer, "pool")
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            keys = make_keys(4)
            data = [pattern(20 + i, SIZE) for i in range(4)]
            assert client(adapter).store(keys[:2], [arena.filled(d) for d in data[:2]]) == [True, True]
            shutil.rmtree(directory)
            assert client(adapter).store(keys[2:], [arena.filled(d) for d in data[2:]]) == [True, True]
            assert client(adapter).lookup_and_lock(keys).found == [True] * 4
            buffers = [arena.take(SIZE) for _ in range(4)]
            assert client(adapter).load(keys, buffers) == [True] * 4
            assert [bytes(b) for b in buffers] == data
            adapter.unlock(keys)
            assert not os.path.exists(directory)
            assert "root_recreated" not in adapter.stats()
        finally:
            adapter.close()


def test_a_pool_beyond_the_open_file_limit_is_refused_naming_pool_size() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > 1048576:
        pytest.skip(f"the hard open-file limit ({hard}) is above the largest pool")
    with scratch_dir() as directory:
        with pytest.raises(FieldError) as caught:
            open_pool(pool_config(directory, pool_size=hard))
        assert caught.value.field == "pool_size", "start-up names the adapter and the value's path"
        assert f"needs {hard} open files" in str(caught.value) and "lower pool_size" in str(caught.value)
        assert os.listdir(directory) == [], "no slot file was created"
