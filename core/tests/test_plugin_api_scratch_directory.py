"""``ScratchDirectory`` from the public plugin API: the fresh directory per test a
persistent backend's suite builds its config on (the generated L2 test names it)."""

from __future__ import annotations

import os
from pathlib import Path

from lmcache_tiers.cli.plugins_new import SkeletonKind, write_plugin
from lmcache_tiers.plugin import ScratchDirectory

_SEEN: list[str] = []


class TestScratchDirectory(ScratchDirectory):
    def test_each_test_gets_an_empty_directory_of_its_own(self) -> None:
        assert os.path.isdir(self.storage_dir) and not os.listdir(self.storage_dir)
        assert self.storage_dir not in _SEEN
        _SEEN.append(self.storage_dir)
        Path(self.storage_dir, "objects.db").write_bytes(b"left behind")

    def test_a_second_test_does_not_see_the_first_ones_files(self) -> None:
        self.test_each_test_gets_an_empty_directory_of_its_own()


def test_the_generated_l2_test_names_it(tmp_path: Path) -> None:
    package = write_plugin("my-store", SkeletonKind.L2, tmp_path)
    assert (
        "ScratchDirectory (from\n    # lmcache_tiers.plugin"
        in (package / "tests" / "test_my_store.py").read_text()
    )
