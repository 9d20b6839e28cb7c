"""A directory where a key's record belongs (made by hand, or by another program) holds no
record: a lookup finds the key absent -- one it counted leaves the usage, as a record
removed behind its back -- and the other keys of the batch are answered as usual.  It is
never taken for a damaged record (nothing to remove), nor fails a remote lookup's batch."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
from fs_helpers import Arena, client, fs_config, load, open_fs, store

from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 8 << 10


def _replace_with_directory(fs: fsspec.AbstractFileSystem, path: str) -> None:
    fs.rm_file(path)
    fs.makedirs(path)
    fs.pipe_file(f"{path}/inside", b"not a record")


@pytest.mark.parametrize("where", ["local", "memory", "dir"])
def test_a_directory_at_a_records_name_is_that_keys_miss_alone(tmp_path: Path, where: str) -> None:
    """``dir://`` over a local directory reports a directory's own size (4096 on ext4),
    ``memory://`` none: either must be told from a record by its type, not its size."""
    fields: dict[str, object] = {}
    if where == "local":
        root, fs, top = str(tmp_path), fsspec.filesystem("file"), str(tmp_path)
    elif where == "memory":
        root = top = f"memory://dir-at-name-{uuid.uuid4().hex}"
        fs = fsspec.filesystem("memory")
    else:
        fields["storage_options"] = {"path": str(tmp_path), "target_protocol": "file"}
        root, fs, top = "dir:///kv", fsspec.filesystem("file"), str(tmp_path / "kv")
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(i, SIZE) for i in range(2)]
    adapter = open_fs(fs_config(root, max_capacity_gb=1, **fields), arena.view)
    try:
        assert store(adapter, arena, keys, data) == [True, True]
        _replace_with_directory(fs, f"{top}/{keys[0].file_stem()}.bin")
        result = client(adapter).lookup_and_lock(keys)
        assert result.found == [False, True], "a directory is no record; the other key is still a hit"
        assert load(adapter, arena, keys[1:], result.sizes[1:]) == ([True], data[1:])
        adapter.unlock(keys[1:])
        stats = adapter.stats()
        assert stats.get("objects_vanished") == 1
        assert adapter.used_bytes() == SIZE
        for judged_damaged in (
            "truncated_records_removed",
            "corrupt_records_removed",
            "corrupt_remove_failures",
        ):
            assert stats.get(judged_damaged, 0) == 0, judged_damaged
        assert stats.get("backend_errors", 0) == 0
    finally:
        adapter.close()
        if where == "memory":
            fs.rm(root, recursive=True)
