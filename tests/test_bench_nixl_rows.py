"""bench_nixl: the two-thread checksummed load -- the most a verified load gets out of two
cores, which nixl_store_dynamic's loads are compared with -- hashes every object it
loads, on the thread that read it, right after the read."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from bench_modules import load_bench

from lmcache_tiers.l2.workers import BatchWorkers

bench_nixl = load_bench("bench_nixl")


def test_two_thread_loads_with_checksum_hash_each_object_after_its_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = bench_nixl.Case(8, 64 << 10)
    buffers = bench_nixl.Buffers(case)
    last_read = threading.local()
    hashed: list[bytes] = []
    real_preadv = bench_nixl.os.preadv

    def preadv(fd: int, views: list[memoryview], offset: int) -> int:
        last_read.view = views[0]
        return real_preadv(fd, views, offset)

    def checksum(view: memoryview) -> None:
        assert view is getattr(last_read, "view", None)  # this thread's read, just now
        hashed.append(bytes(view))

    readers = BatchWorkers(2, "test-read")
    try:
        store, load = bench_nixl.pwrite_new_files(
            str(tmp_path), buffers, prefix="pairsummed", with_checksum=True, readers=readers
        )
        store()
        monkeypatch.setattr(bench_nixl.os, "preadv", preadv)
        monkeypatch.setattr(bench_nixl, "checksum", checksum)
        load()
    finally:
        readers.shutdown()
    buffers.verify()
    assert sorted(hashed) == sorted(bytes(source) for source in buffers.sources)
