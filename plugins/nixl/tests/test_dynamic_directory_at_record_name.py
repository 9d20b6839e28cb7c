"""nixl_store_dynamic: a directory where a key's record belongs (made by hand, or by another
program) holds no record.  A lookup finds that key absent -- one it counted leaves the
usage, as a record removed behind its back -- and answers the other keys of the batch as
usual.  It is never a hit (ext4 sizes a directory at 4096 bytes, the length of a header:
an empty payload), nor a truncated record to remove (tmpfs sizes it smaller)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from nixl_helpers import Arena, client, dynamic_config, open_dynamic

from lmcache_tiers.testing.files import load_data, store_data
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10


@pytest.mark.parametrize("parent", [tempfile.gettempdir(), "/dev/shm"], ids=["tmp", "shm"])
def test_a_directory_at_a_records_name_is_that_keys_miss_alone(parent: str) -> None:
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(i, SIZE) for i in range(2)]
    root = tempfile.mkdtemp(prefix="lmcache-nixl-test-", dir=parent)
    try:
        adapter = open_dynamic(dynamic_config(root), arena.view)
        try:
            assert store_data(adapter, arena, keys, data) == [True, True]
            path = os.path.join(root, f"{keys[0].file_stem()}.bin")
            os.unlink(path)
            os.mkdir(path)
            with open(os.path.join(path, "inside"), "wb") as handle:
                handle.write(b"not a record")
            result = client(adapter).lookup_and_lock(keys)
            assert result.found == [False, True], "a directory is no record; the other key is still a hit"
            assert load_data(adapter, arena, keys[1:], result.sizes[1:]) == ([True], data[1:])
            adapter.unlock(keys[1:])
            stats = adapter.stats()
            assert stats.get("objects_vanished") == 1
            assert adapter.used_bytes() == SIZE
            for judged_damaged in ("truncated_records_removed", "corrupt_records_removed"):
                assert stats.get(judged_damaged, 0) == 0, judged_damaged
            assert stats.get("backend_errors", 0) == 0
            assert os.path.isdir(path), "nothing removed: it is no record of this adapter"
        finally:
            adapter.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
