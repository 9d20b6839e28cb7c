"""``use_odirect``: true refuses a filesystem without O_DIRECT at start-up, "auto" falls
back to the page cache there (and on fsspec URLs), and core's probe tells them apart.

ramfs never takes O_DIRECT (tmpfs does since Linux 6.6), so the refusing filesystem is a
ramfs the tests mount (root; skipped with the reason where mounting is refused)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from fs_helpers import Arena, fs_backend, fs_config, load, open_fs, store
from lmcache_plugin_fs import FsConfig

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.preflight import direct_io_refusal
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.mounts import tmpfs_at

SIZE = 256 << 10


@pytest.fixture
def ramfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A private ramfs: open(O_DIRECT) fails there with EINVAL."""
    with tmpfs_at(str(tmp_path / "ramfs"), "mode=0700", fstype="ramfs") as refused:
        if refused is not None:
            pytest.skip(refused)
        yield tmp_path / "ramfs"


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "disk"
    directory.mkdir()
    if direct_io_refusal(str(directory)) is not None:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT, so there is no O_DIRECT path to test")
    return directory


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*"))


def test_the_probe_tells_ramfs_from_a_disk_and_leaves_nothing(ramfs_dir: Path, disk_dir: Path) -> None:
    refusal = direct_io_refusal(str(ramfs_dir))
    assert refusal is not None and "Invalid argument" in refusal
    assert direct_io_refusal(str(disk_dir)) is None
    assert _entries(ramfs_dir) == [] and _entries(disk_dir) == []


def test_the_probe_raises_what_is_not_a_refusal(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        direct_io_refusal(str(tmp_path / "missing"))


def test_true_refuses_a_ramfs_at_start_up(ramfs_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r'refuses O_DIRECT .*set use_odirect to false or "auto"'):
        open_fs(fs_config(str(ramfs_dir / "l2"), use_odirect=True))
    assert not [name for name in _entries(ramfs_dir) if name.endswith(".part")], "no probe left behind"


@pytest.mark.parametrize("size", [SIZE, SIZE + 123])
def test_auto_on_a_ramfs_goes_through_the_page_cache(
    ramfs_dir: Path, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(50, size), pattern(51, size // 2)]
    with caplog.at_level(logging.INFO, logger="lmcache_plugin_fs.backend"):
        adapter = open_fs(fs_config(str(ramfs_dir / "l2"), use_odirect="auto"), arena.view)
    try:
        assert fs_backend(adapter).direct_io is False
        assert any(
            "refuses O_DIRECT" in r.getMessage() and "page cache" in r.getMessage() for r in caplog.records
        )
        assert store(adapter, arena, keys, data) == [True, True]
        assert load(adapter, arena, keys, [len(d) for d in data]) == ([True, True], data)
        assert adapter.stats().get("direct_io_fallbacks", 0) == 0, "buffered by choice, not a fallback"
    finally:
        adapter.close()


@pytest.mark.parametrize("size", [SIZE, SIZE + 123])
def test_auto_on_a_disk_uses_direct_io(disk_dir: Path, size: int) -> None:
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(60, size), pattern(61, size // 3 + 1)]
    adapter = open_fs(fs_config(str(disk_dir / "l2"), use_odirect="auto"), arena.view)
    try:
        assert fs_backend(adapter).direct_io is True
        assert store(adapter, arena, keys, data) == [True, True]
        assert load(adapter, arena, keys, [len(d) for d in data]) == ([True, True], data)
        assert adapter.stats().get("direct_io_fallbacks", 0) == 0, "aligned buffers take the O_DIRECT path"
    finally:
        adapter.close()


def test_false_stays_buffered_on_a_disk(disk_dir: Path) -> None:
    adapter = open_fs(fs_config(str(disk_dir / "l2")))
    try:
        assert fs_backend(adapter).direct_io is False
    finally:
        adapter.close()


def test_auto_is_accepted_for_fsspec_urls_and_other_strings_are_not() -> None:
    assert fs_config("memory://auto-direct", use_odirect="auto").use_odirect == "auto"
    adapter = open_fs(fs_config(f"memory://auto-direct-{os.getpid()}", use_odirect="auto"))
    try:
        assert fs_backend(adapter).direct_io is False
    finally:
        adapter.close()
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"path": "/tmp/x", "use_odirect": "yes"}, FsConfig)
