"""A local ``relative_tmp_dir`` on another filesystem than the root: every record written
there would fail its rename into the root (EXDEV), so no store could ever succeed.  The
start refuses it in one line; on the root's own filesystem nothing of the check stays."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest
from fs_helpers import fs_config, open_fs

from lmcache_tiers.plugin import ConfigError

OTHER_FILESYSTEM = "/dev/shm"


def test_a_temporary_directory_on_another_filesystem_is_refused_at_start(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    if not os.path.isdir(OTHER_FILESYSTEM) or os.stat(OTHER_FILESYSTEM).st_dev == os.stat(root).st_dev:
        pytest.skip(f"{OTHER_FILESYSTEM} is not another filesystem than {tmp_path}")
    with tempfile.TemporaryDirectory(dir=OTHER_FILESYSTEM) as elsewhere:
        (root / "staging").symlink_to(elsewhere)
        with pytest.raises(ConfigError, match=r"relative_tmp_dir .* is on another filesystem than the root"):
            open_fs(fs_config(str(root), relative_tmp_dir="staging"))
        assert os.listdir(elsewhere) == [], "the check left a file in the temporary directory"
        assert sorted(os.listdir(root)) == ["staging"], "the check left a file in the root"
        # the refused start let go of both directories: a store of either opens now
        open_fs(fs_config(str(root), relative_tmp_dir=f"own-{uuid.uuid4().hex[:8]}")).close()
        open_fs(fs_config(elsewhere)).close()


def test_a_temporary_directory_on_the_root_filesystem_leaves_nothing_of_the_check(tmp_path: Path) -> None:
    adapter = open_fs(fs_config(str(tmp_path), relative_tmp_dir="staging"))
    try:
        assert sorted(os.listdir(tmp_path)) == [".lmcache-tiers-temp-dirs", "staging"]
        assert os.listdir(tmp_path / "staging") == []
    finally:
        adapter.close()
