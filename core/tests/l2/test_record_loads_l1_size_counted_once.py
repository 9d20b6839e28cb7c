"""A record whose header claims an L1 size no object can have (another than its payload's
length under a chain that changes no sizes) is damaged: one load of it counts it once as
``record_l1_size_impossible`` and once as removed -- a batch load (``load_many``), which
hands every record it does not pass to the one-object load to judge, as a single load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import AdapterContext, BackendContext
from lmcache_tiers.l2.files import RECORD_ALIGN, FileLayout, HeaderSizes, LocalFiles
from lmcache_tiers.l2.files.loads import RecordLoads
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.l2.workers import BatchWorkers

KEY = ObjectKey("llama", 0, b"\x05" * 32)
SIZE = 10_000


@pytest.mark.parametrize("mode", ["load", "load_many"])
def test_a_record_claiming_an_impossible_l1_size_is_counted_once(tmp_path: Path, mode: str) -> None:
    state = AdapterState(AdapterContext(index=0, name="0:test", config=L2AdapterConfig()))
    context = BackendContext(state)
    files = LocalFiles(FileLayout(str(tmp_path), shard_dirs=True), name="0:test", count=context.count)
    sizes = HeaderSizes(lambda key, payload: context.record_header(key, payload, align=RECORD_ALIGN))
    loads = RecordLoads(files, context, sizes.length)
    data = bytes(range(256)) * (SIZE // 256)
    path = files.layout.path_for(KEY)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:  # its header crc matches: forged or miswritten, not torn
        handle.write(encode_header(KEY, data, l1_size=len(data) + 4096, align=RECORD_ALIGN) + data)

    buffer = memoryview(bytearray(len(data)))
    if mode == "load":
        loaded = loads.load(KEY, buffer)
    else:
        (loaded,) = loads.load_many([KEY], [buffer], BatchWorkers(1, "test-one"))

    assert loaded is False
    assert not os.path.exists(path)
    counters = state.counters.snapshot()
    assert counters.get("corrupt_records_removed") == 1
    assert counters.get("record_l1_size_impossible") == 1, counters
