"""The start-up scan of a huge flat directory: the listing hands out records as it reads
the directory, instead of holding an entry for every file before the first record."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest
from fs_helpers import HEADER

from lmcache_tiers.l2.files import FileLayout, LocalFiles
from lmcache_tiers.testing.l2 import make_keys

FILES = 20_000
#: far below what an entry per file costs (a few hundred bytes each: megabytes here)
FIRST_RECORD_MEMORY = 512 << 10


def test_the_listing_yields_the_first_record_before_reading_the_whole_directory(tmp_path: Path) -> None:
    for key in make_keys(FILES):
        with open(tmp_path / f"{key.file_stem()}.bin", "wb") as record:
            record.truncate(HEADER)  # an empty payload: listed from its name and size
    files = LocalFiles(FileLayout(str(tmp_path), shard_dirs=False), name="scan", count=lambda _n, _c: None)
    listing = files.iter_records(lambda _key: HEADER)
    tracemalloc.start()
    try:
        _key, stored = next(listing)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        listing.close()
    assert stored == 0
    assert peak < FIRST_RECORD_MEMORY, f"{peak} bytes held to list the first of {FILES} records"
    assert sum(1 for _ in files.iter_records(lambda _key: HEADER)) == len(os.listdir(tmp_path))


def test_removing_every_record_of_a_huge_directory_holds_no_entry_per_file(tmp_path: Path) -> None:
    for key in make_keys(FILES):
        with open(tmp_path / f"{key.file_stem()}.bin", "wb") as record:
            record.truncate(HEADER)
    (tmp_path / "notes.txt").write_text("not a record: left alone")
    files = LocalFiles(FileLayout(str(tmp_path), shard_dirs=False), name="drop", count=lambda _n, _c: None)
    tracemalloc.start()
    try:
        removed = files.remove_all_records()
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert removed == FILES
    assert os.listdir(tmp_path) == ["notes.txt"]
    assert peak < FIRST_RECORD_MEMORY, f"{peak} bytes held to remove {FILES} records"


def test_records_a_reading_hid_while_files_were_removed_are_removed_by_another_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NFS or CIFS a directory read while its files are removed may skip some of the
    others (POSIX allows it); the sweep reads again until nothing is left.  Such a
    filesystem cannot run here: the first reading is cut short instead."""
    keys = make_keys(40)
    for key in keys:
        with open(tmp_path / f"{key.file_stem()}.bin", "wb") as record:
            record.truncate(HEADER)
    real_scandir = os.scandir
    readings = []

    class HalfReading:
        """The first reading of the directory ends after half its files."""

        def __init__(self, path: str) -> None:
            self._entries = real_scandir(path)
            self._left = len(keys) // 2 if not readings else None
            readings.append(path)

        def __enter__(self) -> HalfReading:
            return self

        def __exit__(self, *exc: object) -> None:
            self._entries.close()

        def __iter__(self) -> HalfReading:
            return self

        def __next__(self) -> os.DirEntry[str]:
            if self._left is not None:
                if self._left == 0:
                    raise StopIteration
                self._left -= 1
            return next(self._entries)

    files = LocalFiles(FileLayout(str(tmp_path), shard_dirs=False), name="drop", count=lambda _n, _c: None)
    monkeypatch.setattr(os, "scandir", HalfReading)
    assert files.remove_all_records() == len(keys)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
