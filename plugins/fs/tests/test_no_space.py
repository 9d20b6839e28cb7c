"""A full filesystem (a real 1 MiB tmpfs): the records that fit are stored, the rest fail
cleanly, counted and logged once per burst; nothing half-written is visible; stores work
again once space returns (core's check, shared with nixl_store_dynamic)."""

from __future__ import annotations

from fs_helpers import fs_config, open_fs

from lmcache_tiers.testing.files import check_full_disk_batch


def test_a_batch_that_hits_enospc_stores_what_fits() -> None:
    check_full_disk_batch(lambda root, arena: open_fs(fs_config(root), arena))
