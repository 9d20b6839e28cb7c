"""nixl_store_dynamic: a load finding the key's record replaced by an intact one of another
size is a miss counted (``load_size_changed``) and logged by the adapter, the record kept."""

from __future__ import annotations

import os

import pytest
from nixl_helpers import Arena, client, dynamic_config, open_dynamic, scratch_dir

from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.testing.files import load_data, store_data
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10


@pytest.mark.parametrize("direct_io", [False, True], ids=["plain", "direct"])
def test_a_record_replaced_by_one_of_another_size_is_a_counted_miss_that_is_kept(
    direct_io: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The lookup said 64 KiB, then the key's file was replaced by an intact record of
    128 KiB (another writer with another chunk size): the load of a 64 KiB buffer is a
    miss counted and logged as nixl_store counts it -- not left to core's one more failed
    key -- and the record is neither judged damaged nor removed."""
    arena = Arena()
    (key,) = make_keys(1)
    with scratch_dir() as root:
        adapter = open_dynamic(dynamic_config(root, direct_io=direct_io), arena.view)
        try:
            assert store_data(adapter, arena, [key], [pattern(1, SIZE)]) == [True]
            assert client(adapter).lookup_and_lock([key]).sizes == [SIZE]
            # Another server sharing the directory publishes its record of the key over
            # this one's: core here still accounts the key at 64 KiB.
            path = os.path.join(root, f"{key.file_stem()}.bin")
            record = encode_header(key, pattern(2, 2 * SIZE), align=4096) + pattern(2, 2 * SIZE)
            with open(path + ".new", "wb") as handle:
                handle.write(record)
            os.replace(path + ".new", path)
            ok, _ = load_data(adapter, arena, [key], [SIZE])
            adapter.unlock([key])
            assert ok == [False]
            stats = adapter.stats()
            assert stats.get("load_size_changed", 0) == 1
            assert stats.get("corrupt_records_removed", 0) == 0
            lines = [r.getMessage() for r in caplog.records if "a load expected" in r.getMessage()]
            assert len(lines) == 1 and "replaced since the lookup" in lines[0], lines
            with open(path, "rb") as handle:
                assert handle.read() == record, "the record is kept"
        finally:
            adapter.close()
