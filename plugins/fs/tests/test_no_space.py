"""A full filesystem (a real 1 MiB tmpfs): the records that fit are stored, the rest fail
cleanly, counted and logged once per burst; nothing half-written is visible; stores work
again once space returns; a write error reported only at a file's close (NFS) fails the
store before anything is published (core's checks, shared with nixl_store_dynamic)."""

from __future__ import annotations

import contextlib
import logging
import os

import pytest
from fs_helpers import fs_config, open_fs

from lmcache_tiers.testing.files import check_close_error_fails_store, check_full_disk_batch, small_tmpfs


def test_a_batch_that_hits_enospc_stores_what_fits() -> None:
    check_full_disk_batch(lambda root, arena: open_fs(fs_config(root), arena))


def test_a_write_error_reported_at_close_publishes_nothing() -> None:
    check_close_error_fails_store(lambda root, arena: open_fs(fs_config(root), arena))


def test_a_full_root_at_start_up_leaves_no_half_written_record_of_temp_dirs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The record of temporary directories is written at every start that changes it; on a
    full root that write fails -- counted and logged, the start goes on -- and leaves no
    staged file behind, which no sweep would ever remove."""
    with small_tmpfs(64 << 10) as root:
        os.mkdir(os.path.join(root, "staging"))
        filler = os.path.join(root, "filler")
        with contextlib.suppress(OSError), open(filler, "wb") as handle:
            handle.write(b"x" * (1 << 20))
        with caplog.at_level(logging.WARNING):
            adapter = open_fs(fs_config(root, relative_tmp_dir="staging"))
        try:
            assert adapter.stats()["temp_dir_record_failures"] == 1
            assert any("cannot write" in r.getMessage() for r in caplog.records)
        finally:
            adapter.close()
        assert sorted(os.listdir(root)) == ["filler", "staging"]
        os.remove(filler)  # space returns: the next start writes the record
        adapter = open_fs(fs_config(root, relative_tmp_dir="staging"))
        try:
            assert adapter.stats().get("temp_dir_record_failures", 0) == 0
        finally:
            adapter.close()
        with open(os.path.join(root, ".lmcache-tiers-temp-dirs")) as record:
            assert record.read() == "staging\n"
