"""A mapping file a server of an earlier release (28c5b5b, 2026-12-02) formatted and filled,
opened by this release: a rolling upgrade keeps its objects, with their own bytes.

The image (gzipped, mostly zeros) was written by that release's adapter with the data of
``_objects`` under ``make_keys(6)``, no serde, 16 slots of 64 KiB (``dax_helpers.config``)."""

from __future__ import annotations

import gzip
from pathlib import Path

from dax_helpers import config, load, open_dax

from lmcache_tiers.testing.l2 import make_keys

IMAGE = Path(__file__).parent / "data" / "dax_28c5b5b.img.gz"


def _objects() -> list[bytes]:
    return [bytes([i + 1]) * 20000 + bytes(range(256)) * 40 for i in range(6)]


def test_a_mapping_file_an_earlier_release_wrote_is_reopened_with_its_objects(tmp_path: Path) -> None:
    device = tmp_path / "dax.img"
    device.write_bytes(gzip.decompress(IMAGE.read_bytes()))
    adapter = open_dax(config(device))
    try:
        data = _objects()
        assert load(adapter, make_keys(6), [len(d) for d in data]) == ([True] * 6, data)
        stats = adapter.stats()
        assert stats["recovered_objects"] == 6
        assert stats.get("record_version_unknown", 0) == 0
    finally:
        adapter.close()
