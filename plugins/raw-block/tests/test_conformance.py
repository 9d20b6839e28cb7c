"""``raw_block`` against the L2 adapter conformance suite, on a preallocated file."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_plugin_raw_block import RawBlockConfig

from lmcache_tiers.plugin import (
    CAPACITY,
    EVICTION,
    IMMEDIATE_HITS,
    IMMEDIATE_MISSES,
    PERSISTENCE,
    DeflateSerde,
    L2AdapterSuite,
)

#: 16 KiB payloads (the suite's objects) in 20 KiB slots
SLOT = 20 << 10
SLOTS = 64
#: what the adapter sizes the metadata to for 64 slots: a superblock and two 64 KiB areas
META = 4096 + 2 * (64 << 10)


class TestRawBlockFile(L2AdapterSuite):
    component_name = "raw_block"
    # Usage is the fraction of slots taken; deletes free slots; objects survive restarts.
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, IMMEDIATE_MISSES, IMMEDIATE_HITS})
    use_odirect = True
    slot_bytes = SLOT

    @pytest.fixture(autouse=True)
    def _device_file(self) -> Iterator[None]:
        # Autouse fixtures run before the suite's adapter fixture, which calls make_config.
        directory = tempfile.mkdtemp(prefix="lmcache-raw-block-suite-")
        self.device_path = str(Path(directory) / "device.img")
        yield
        shutil.rmtree(directory, ignore_errors=True)

    def make_config(self) -> RawBlockConfig:
        return RawBlockConfig(
            device_path=self.device_path,
            slot_bytes=self.slot_bytes,
            capacity_bytes=META + SLOTS * self.slot_bytes,
            use_odirect=self.use_odirect,
        )


class TestRawBlockBufferedFile(TestRawBlockFile):
    """The same suite through the page cache (use_odirect false)."""

    use_odirect = False


class TestRawBlockFileWithSerde(TestRawBlockFile):
    serde = (DeflateSerde(),)
    slot_bytes = SLOT + 4096  # room for the frames, a little over the objects
