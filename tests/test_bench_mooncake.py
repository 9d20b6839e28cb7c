"""bench_mooncake's ``records`` row against a real Mooncake pool: the client alone reads
the records as the adapter reads them into its L1 arena, so that the row tells the
record layout's cost apart from the adapter's checks and threads."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench_modules import load_bench

cluster_module = pytest.importorskip("lmcache_plugin_mooncake.cluster")
if cluster_module.unavailable_reason() is not None:
    pytest.skip(cluster_module.unavailable_reason(), allow_module_level=True)
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

SIZE = 64 << 10
COUNT = 4


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    started = cluster_module.LocalCluster(tmp_path / "mooncake").start()
    try:
        started.add_segment_host("64MB")
        yield started
    finally:
        started.stop()


def test_the_records_row_reads_them_as_the_adapter_reads_into_l1(cluster: Any) -> None:
    from lmcache_plugin_mooncake.headers import HEADER_BYTES

    bench_mooncake = load_bench("bench_mooncake")
    arena = memoryview(mmap.mmap(-1, 2 * COUNT * SIZE + COUNT * HEADER_BYTES))
    src, dst = arena[: COUNT * SIZE], arena[COUNT * SIZE : 2 * COUNT * SIZE]
    headers = arena[2 * COUNT * SIZE :]
    src[:] = os.urandom(src.nbytes)
    direct = bench_mooncake.Direct(cluster, src, dst, headers)
    called: list[str] = []
    direct.store = cluster_module.NotedCalls(direct.store, called)
    names = [f"records-{i}" for i in range(COUNT)]
    headers[:] = os.urandom(headers.nbytes)
    written_headers = bytes(headers)
    try:
        direct.put_records(names, SIZE)
        headers[:] = bytes(headers.nbytes)
        direct.get_records(names, SIZE)
    finally:
        direct.remove(names)
        direct.store.store.close()
    # under one get session for the batch, as the adapter's load into L1
    assert called[1:5] == [
        "batch_get_session_start",
        "batch_get_into_multi_buffer_ranges",
        "batch_get_session_end",
        "batch_remove",
    ], called
    assert dst.tobytes() == src.tobytes()
    assert bytes(headers) == written_headers, "each header read back into the scratch"
