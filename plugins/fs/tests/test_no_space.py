"""A full filesystem (a real 1 MiB tmpfs): the records that fit are stored, the rest fail
cleanly, counted and logged once per burst; nothing half-written is visible; stores work
again once space returns; a write error reported only at a file's close (NFS) fails the
store before anything is published (core's checks, shared with nixl_store_dynamic)."""

from __future__ import annotations

from fs_helpers import fs_config, open_fs

from lmcache_tiers.testing.files import check_close_error_fails_store, check_full_disk_batch


def test_a_batch_that_hits_enospc_stores_what_fits() -> None:
    check_full_disk_batch(lambda root, arena: open_fs(fs_config(root), arena))


def test_a_write_error_reported_at_close_publishes_nothing() -> None:
    check_close_error_fails_store(lambda root, arena: open_fs(fs_config(root), arena))
