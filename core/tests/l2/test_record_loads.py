"""Whole loads of record files (l2/files/loads.py): a buffer is reported loaded only once
all of it verified; every other file is a miss, kept when it is another intact object and
removed (and counted) when it is damaged.  Every case runs through both ways of loading:
one object at a time (``load``) and a batch (``load_many``), which must judge alike."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import AdapterContext, BackendContext
from lmcache_tiers.l2.files import RECORD_ALIGN, FileLayout, HeaderSizes, LocalFiles
from lmcache_tiers.l2.files.loads import RecordLoads
from lmcache_tiers.l2.record import CHECKSUM_BLAKE3_128, checksum, encode_header
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.l2.workers import BatchWorkers

KEY = ObjectKey("llama", 0, b"\x05" * 32)


class Store:
    """A local record store as fs and nixl_store_dynamic keep it, with RecordLoads."""

    def __init__(self, root: Path, mode: str = "load") -> None:
        self.mode = mode
        self.state = AdapterState(AdapterContext(index=0, name="0:test", config=L2AdapterConfig()))
        self.context = BackendContext(self.state)
        self.files = LocalFiles(
            FileLayout(str(root), shard_dirs=True), name="0:test", count=self.context.count
        )
        self.sizes = HeaderSizes(
            lambda key, payload: self.context.record_header(key, payload, align=RECORD_ALIGN)
        )
        self.loads = RecordLoads(self.files, self.context, self.sizes.length)

    def write(self, key: ObjectKey, payload: bytes, *, tail: bytes = b"") -> str:
        path = self.files.layout.path_for(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        header = self.context.record_header(key, memoryview(payload), align=RECORD_ALIGN)
        with open(path, "wb") as handle:
            handle.write(header + payload + tail)
        return path

    def load(self, key: ObjectKey, length: int) -> tuple[bool, bytes]:
        buffer = bytearray(length)
        if self.mode == "load":
            return self.loads.load(key, memoryview(buffer)), bytes(buffer)
        (loaded,) = self.loads.load_many([key], [memoryview(buffer)], BatchWorkers(1, "test-one"))
        return loaded, bytes(buffer)

    def counter(self, name: str) -> int:
        return self.state.counters.snapshot().get(name, 0)


def payload_of(size: int, seed: int = 3) -> bytes:
    return bytes((seed * 17 + i * 13) % 251 for i in range(size))


@pytest.fixture(params=["load", "load_many"])
def store(tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    return Store(tmp_path / "root", request.param)


@pytest.mark.parametrize("size", [0, 1, 4096, (1 << 20) + 3, (3 << 20) + 5])
def test_a_stored_record_loads_verified(store: Store, size: int) -> None:
    data = payload_of(size)
    store.write(KEY, data)
    assert store.load(KEY, size) == (True, data)


def test_a_missing_file_is_a_quiet_miss(store: Store) -> None:
    assert store.load(KEY, 100) == (False, bytes(100))
    assert store.counter("corrupt_records_removed") == 0


@pytest.mark.parametrize("where", [0, 4095, (1 << 20) + 100, (2 << 20) - 1])
def test_a_flipped_payload_byte_is_a_miss_and_the_file_goes(store: Store, where: int) -> None:
    data = payload_of(2 << 20)
    path = store.write(KEY, data)
    with open(path, "r+b") as handle:
        handle.seek(store.sizes.length(KEY) + where)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    assert store.load(KEY, len(data))[0] is False
    assert not os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 1


def test_a_truncated_record_is_removed(store: Store) -> None:
    data = payload_of(10_000)
    path = store.write(KEY, data)
    os.truncate(path, store.sizes.length(KEY) + 5_000)
    assert store.load(KEY, len(data))[0] is False
    assert not os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 1


def test_an_intact_record_of_another_size_is_a_miss_that_is_kept(store: Store) -> None:
    path = store.write(KEY, payload_of(8_000))
    assert store.load(KEY, 5_000)[0] is False  # the file is longer than this load expects
    assert store.load(KEY, 9_000)[0] is False  # ... and shorter
    assert os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 0
    assert store.counter("load_size_changed") == 2
    assert store.load(KEY, 8_000) == (True, payload_of(8_000))


def test_bytes_past_a_records_payload_never_reach_a_buffer(store: Store) -> None:
    data = payload_of(4_000)
    path = store.write(KEY, data, tail=b"junk")
    # A load of the header's length gets the verified payload and nothing after it ...
    assert store.load(KEY, len(data)) == (True, data)
    # ... one of the file's length finds a header naming other lengths: damage, removed.
    assert store.load(KEY, len(data) + 4)[0] is False
    assert not os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 1


@pytest.mark.parametrize("extra", [0, 100], ids=["same-size", "other-size"])
def test_another_keys_intact_record_under_this_name_is_a_counted_miss_that_is_kept(
    store: Store, extra: int
) -> None:
    # No damage makes one (the header's crc covers the key); another writer does -- keys
    # that differ only in case share one file on a case-insensitive filesystem.
    other = ObjectKey("Llama", 0, b"\x05" * 32)
    data = payload_of(3_000)
    path = store.files.layout.path_for(KEY)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(encode_header(other, data, align=RECORD_ALIGN) + data)
    assert store.load(KEY, len(data) + extra)[0] is False  # (a failed load's buffer is not read)
    assert os.path.exists(path)
    assert store.counter("foreign_records") == 1
    assert store.counter("corrupt_records_removed") == 0


def test_an_unreadable_file_is_a_logged_miss(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    path = store.write(KEY, payload_of(100))
    os.unlink(path)
    os.mkdir(path)  # opening a directory for reading works; reading it fails (EISDIR)
    assert store.load(KEY, 100)[0] is False
    assert "cannot read" in caplog.text
    assert os.path.isdir(path)


def test_a_batch_loads_on_two_threads(store: Store) -> None:
    keys = [ObjectKey("llama", 0, bytes([i]) * 32) for i in range(16)]
    payloads = [payload_of(70_000 + i, seed=i) for i in range(16)]
    for key, data in zip(keys, payloads, strict=True):
        store.write(key, data)
    os.truncate(store.files.layout.path_for(keys[5]), 100)  # one damaged object fails alone
    buffers = [memoryview(bytearray(len(data))) for data in payloads]
    workers = BatchWorkers(2, "test-loads")
    try:
        if store.mode == "load":
            loaded = workers.map(store.loads.load, keys, buffers)
        else:
            loaded = store.loads.load_many(keys, buffers, workers)
        assert loaded == [i != 5 for i in range(16)]
    finally:
        workers.shutdown()
    assert [bytes(b) for i, b in enumerate(buffers) if i != 5] == payloads[:5] + payloads[6:]
    assert store.counter("corrupt_records_removed") == 1


def write_raw(store: Store, key: ObjectKey, record: bytes) -> str:
    path = store.files.layout.path_for(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(record)
    return path


def test_a_record_of_another_serde_chain_is_a_counted_miss_that_is_kept(store: Store) -> None:
    data = payload_of(5_000)
    path = write_raw(store, KEY, encode_header(KEY, data, serde=("zstd",), align=RECORD_ALIGN) + data)
    assert store.load(KEY, len(data))[0] is False
    assert os.path.exists(path)
    assert store.counter("serde_chain_mismatch") == 1
    assert store.counter("corrupt_records_removed") == 0


@pytest.mark.parametrize("size", [3_000, (2 << 20) + 7])
def test_a_record_with_the_first_blake3_checksum_still_loads(store: Store, size: int) -> None:
    data = payload_of(size)
    header = bytearray(encode_header(KEY, data, align=RECORD_ALIGN))
    algo_at = struct.calcsize("<4sHHIQQ")
    header[algo_at] = CHECKSUM_BLAKE3_128
    header[algo_at + 4 : algo_at + 20] = checksum(data, CHECKSUM_BLAKE3_128)
    header[-4:] = struct.pack("<I", zlib.crc32(bytes(header[:-4])))
    path = write_raw(store, KEY, bytes(header) + data)
    assert store.load(KEY, size) == (True, data)
    flipped = bytearray(data)
    flipped[size // 2] ^= 0x10
    write_raw(store, KEY, bytes(header) + bytes(flipped))
    assert store.load(KEY, size)[0] is False
    assert not os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 1


def test_a_flipped_header_padding_byte_is_damage(store: Store) -> None:
    data = payload_of(4_000)
    path = store.write(KEY, data)
    with open(path, "r+b") as handle:
        handle.seek(RECORD_ALIGN - 100)  # in the zero padding before the header crc
        handle.write(b"\x01")
    assert store.load(KEY, len(data))[0] is False
    assert not os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 1


def test_a_batch_judges_each_object_alone(tmp_path: Path) -> None:
    """Hits, a missing key, damage, another chain and another size in one batch."""
    store = Store(tmp_path / "root", "load_many")
    keys = [ObjectKey("llama", 0, bytes([i + 1]) * 32) for i in range(6)]
    payloads = [payload_of(20_000 + i, seed=i) for i in range(6)]
    paths = [store.write(key, data) for key, data in zip(keys, payloads[:5], strict=False)]
    with open(paths[1], "r+b") as handle:  # 1: a flipped payload byte
        handle.seek(RECORD_ALIGN + 10)
        handle.write(b"\xff")
    data = payloads[2]  # 2: intact, another serde chain
    write_raw(store, keys[2], encode_header(keys[2], data, serde=("zstd",), align=RECORD_ALIGN) + data)
    store.write(keys[3], payloads[3] + b"more")  # 3: intact, another size
    # 5: never stored
    buffers = [memoryview(bytearray(len(data))) for data in payloads]
    workers = BatchWorkers(2, "test-batch")
    try:
        assert store.loads.load_many(keys, buffers, workers) == [True, False, False, False, True, False]
    finally:
        workers.shutdown()
    assert bytes(buffers[0]) == payloads[0] and bytes(buffers[4]) == payloads[4]
    assert [os.path.exists(path) for path in paths] == [True, False, True, True, True]
    assert store.counter("corrupt_records_removed") == 1
    assert store.counter("serde_chain_mismatch") == 1


def test_batches_larger_and_smaller_than_the_kept_header_block_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_tiers.l2.files import loads

    monkeypatch.setattr(loads, "_KEPT_BATCH_BYTES", 3 * RECORD_ALIGN)
    store = Store(tmp_path / "root", "load_many")
    keys = [ObjectKey("llama", 0, bytes([i + 1]) * 32) for i in range(5)]
    payloads = [payload_of(1_000 + i, seed=i) for i in range(5)]
    for key, data in zip(keys, payloads, strict=True):
        store.write(key, data)
    workers = BatchWorkers(2, "test-blocks")
    try:
        for count in (5, 2, 5, 3):  # a block of its own, the kept one, again, reused
            buffers = [memoryview(bytearray(len(data))) for data in payloads[:count]]
            assert store.loads.load_many(keys[:count], buffers, workers) == [True] * count
            assert [bytes(b) for b in buffers] == payloads[:count]
    finally:
        workers.shutdown()


def test_a_load_running_when_the_adapter_closes_reads_nothing_more_into_its_buffer(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Core closes a backend past its deadline even while a load still reads (a hung
    mount); the load's buffers then belong to others: no later piece may land in them,
    and the load is a miss.  Only the read already in flight may finish."""
    size = (3 << 20) + 5  # a header read with the first piece, then three more pieces
    data = payload_of(size)
    path = store.write(KEY, data)
    preadv = os.preadv
    reads_after_close: list[int] = []

    def closing_after_the_first_read(fd: int, buffers: list[memoryview], offset: int) -> int:
        if store.state.closing.is_set():
            reads_after_close.append(offset)
        got = preadv(fd, buffers, offset)
        store.state.closing.set()  # close starts while this read was in flight
        return got

    monkeypatch.setattr(os, "preadv", closing_after_the_first_read)
    assert store.load(KEY, size) == (False, data[: 1 << 20] + bytes(size - (1 << 20)))
    assert reads_after_close == []
    assert os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 0
    # Closed, a load does not even open the record.
    assert store.load(KEY, size) == (False, bytes(size))
    assert reads_after_close == []


def test_a_load_whose_open_was_stuck_when_the_adapter_closed_reads_nothing_into_its_buffer(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open stuck in a hung mount returns after close began: the buffer may belong to
    another object by then, so not even the header and first piece may be read into it."""
    size = (1 << 20) + 5
    data = payload_of(size)
    store.write(KEY, data)
    real_open = os.open
    reads: list[int] = []

    def stuck_until_closing(path: str, flags: int, *args: int) -> int:
        fd = real_open(path, flags, *args)
        store.state.closing.set()  # close started while the open was in flight
        return fd

    def counted(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append(offset)
        return 0

    monkeypatch.setattr(os, "open", stuck_until_closing)
    monkeypatch.setattr(os, "preadv", counted)
    assert store.load(KEY, size) == (False, bytes(size))
    assert reads == []


def test_an_intact_record_whose_header_length_differs_is_kept_and_explained(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The payload a load expected, behind a header of another length (not padded to the
    block): a miss, kept, and the line names both lengths -- not two equal payload sizes."""
    data = payload_of(5_000)
    unpadded = encode_header(KEY, data)
    path = write_raw(store, KEY, unpadded + data)
    with caplog.at_level("INFO", logger="lmcache_tiers.l2"):
        assert store.load(KEY, len(data))[0] is False
    assert os.path.exists(path)
    assert store.counter("corrupt_records_removed") == 0
    assert store.counter("load_size_changed") == 1
    (line,) = [r.getMessage() for r in caplog.records if "a load expected" in r.getMessage()]
    size = len(unpadded) + len(data)
    assert f"a record of {size} bytes (header {len(unpadded)}, payload {len(data)})" in line
    assert f"a load expected {RECORD_ALIGN + len(data)} (header {RECORD_ALIGN}, payload {len(data)})" in line
