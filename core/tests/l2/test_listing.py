"""The start-up listing of a local file store: no record it cannot serve is skipped unseen.

A digest-named record whose header cannot be read is removed and counted like a damaged
named one; records where this layout does not put their key are kept, counted and
reported.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from lmcache_tiers.keycodec import is_digest_name
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.files import FileLayout, LocalFiles, identity_of, record_name
from lmcache_tiers.l2.record import encode_header

HEADER = 4096


def _files(root: Path, counts: dict[str, int], *, sharded: bool = False) -> LocalFiles:
    def count(name: str, amount: int) -> None:
        counts[name] = counts.get(name, 0) + amount

    return LocalFiles(FileLayout(str(root), shard_dirs=sharded), name="t", count=count)


def _store(files: LocalFiles, key: ObjectKey, payload: bytes) -> str:
    fd, temp = files.create_temp(key)
    os.write(fd, encode_header(key, payload, align=HEADER) + payload)
    os.close(fd)
    files.publish(key, temp)
    return files.layout.path_for(key)


def _long_key(n: int) -> ObjectKey:
    """A key whose readable name does not fit in a file name: it gets a digest name."""
    key = ObjectKey("m" * 250, 0, bytes([n]) * 32, 0, "s" * 100)
    assert is_digest_name(record_name(key).removesuffix(".bin"))
    return key


def _listed(files: LocalFiles) -> dict[ObjectKey, int]:
    return dict(files.iter_records(lambda _key: HEADER))


@pytest.mark.parametrize("sharded", [False, True])
def test_digest_records_whose_header_cannot_be_read_are_removed_and_counted(
    tmp_path: Path, sharded: bool, caplog: pytest.LogCaptureFixture
) -> None:
    counts: dict[str, int] = {}
    files = _files(tmp_path, counts, sharded=sharded)
    keys = [_long_key(n) for n in range(6)]
    paths = [_store(files, key, b"x" * 100) for key in keys]
    os.truncate(paths[1], 0)  # zero-length
    os.truncate(paths[2], 100)  # torn inside the header
    with open(paths[3], "r+b") as handle:  # garbage where the header was
        handle.write(b"\xff" * 64)
    shutil.copyfile(paths[5], paths[4])  # another key's record under this key's name
    with caplog.at_level(logging.WARNING):
        assert _listed(files) == {keys[0]: 100, keys[5]: 100}
    assert counts["truncated_records_removed"] == 2
    assert counts["corrupt_records_removed"] == 2
    assert [os.path.exists(path) for path in paths] == [True, False, False, False, False, True]
    assert sum("removed" in record.getMessage() for record in caplog.records) == 4
    assert _listed(files) == {keys[0]: 100, keys[5]: 100}
    assert counts["truncated_records_removed"] == 2 and counts["corrupt_records_removed"] == 2


def test_a_digest_record_replaced_after_it_was_judged_is_kept(tmp_path: Path) -> None:
    counts: dict[str, int] = {}
    files = _files(tmp_path, counts)
    key = _long_key(7)
    path = _store(files, key, b"old")
    os.truncate(path, 0)
    judged = identity_of(os.stat(path))
    _store(files, key, b"new")
    assert not files._discard_unkeyed(path, judged, "truncated_records_removed", "empty")
    assert _listed(files) == {key: 3} and counts == {}


@pytest.mark.parametrize("sharded", [False, True])
def test_records_of_the_other_layout_are_kept_counted_and_reported(
    tmp_path: Path, sharded: bool, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [ObjectKey("m", 0, bytes([n]) * 32) for n in range(3)] + [_long_key(3)]
    before = _files(tmp_path, {}, sharded=not sharded)
    paths = [_store(before, key, b"y" * 10) for key in keys]
    counts: dict[str, int] = {}
    files = _files(tmp_path, counts, sharded=sharded)
    with caplog.at_level(logging.WARNING):
        assert _listed(files) == {}
    assert counts == {"records_other_layout": 4}
    assert all(os.path.exists(path) for path in paths), "kept: the setting may be switched back"
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "4 records" in messages[0]
    assert f"set shard_dirs back to {str(not sharded).lower()}" in messages[0]
    assert _listed(_files(tmp_path, {}, sharded=not sharded)) == dict.fromkeys(keys, 10)


def test_records_moved_out_of_their_shard_are_kept_counted_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    counts: dict[str, int] = {}
    files = _files(tmp_path, counts, sharded=True)
    key = ObjectKey("m", 0, b"\x12\x34" * 16)
    path = _store(files, key, b"z" * 10)
    moved = tmp_path / "ff" / "ee" / os.path.basename(path)
    moved.parent.mkdir(parents=True)
    os.rename(path, moved)
    with caplog.at_level(logging.WARNING):
        assert _listed(files) == {}
    assert counts == {"records_misplaced": 1} and moved.exists()
    assert any("not where either layout puts their key" in r.getMessage() for r in caplog.records)
