"""A record a 28c5b5b server (2026-12-02) wrote with nixl_store_dynamic is read by this release.

fixtures/record-28c5b5b.bin is the file that release wrote for ``make_keys(1)[0]`` with the
bytes ``pattern(0, 600)`` and no serde (docs/upgrading.md): the record format is version 1 in
both releases, so a server of this release taking over the directory serves it as it is and
neither counts nor removes it as damage.
"""

from __future__ import annotations

import os
import shutil

from nixl_helpers import Arena, dynamic_config, open_dynamic, scratch_dir

from lmcache_tiers.testing.files import load_data
from lmcache_tiers.testing.l2 import make_keys, pattern

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "record-28c5b5b.bin")
SIZE = 600


def test_record_of_28c5b5b_is_served_and_kept() -> None:
    arena = Arena()
    key = make_keys(1)[0]
    name = f"{key.file_stem()}.bin"
    with scratch_dir() as root:
        shutil.copyfile(FIXTURE, os.path.join(root, name))
        adapter = open_dynamic(dynamic_config(root), arena.view)
        try:
            assert load_data(adapter, arena, [key], [SIZE]) == ([True], [pattern(0, SIZE)])
            stats = adapter.stats()
            assert not stats.get("corrupt_records_removed")
            assert not stats.get("record_version_unknown")
        finally:
            adapter.close()
        assert os.listdir(root) == [name]
