"""``dax`` against the L2 adapter conformance suite, on files in /dev/shm mapped shared."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_plugin_dax import DaxConfig, DaxDevice

from lmcache_tiers.plugin import (
    CAPACITY,
    EVICTION,
    IMMEDIATE_HITS,
    IMMEDIATE_MISSES,
    PERSISTENCE,
    DeflateSerde,
    L2AdapterSuite,
)

SLOT = 16 << 10  # the suite's objects
#: a superblock, 64 index entries and 64 slots
SIZE_GB = (4096 + 64 * (4096 + SLOT)) / (1 << 30)


class TestDaxFile(L2AdapterSuite):
    component_name = "dax"
    # Usage is the fraction of slots taken; deletes free slots; the index survives restarts.
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, IMMEDIATE_MISSES, IMMEDIATE_HITS})

    @pytest.fixture(autouse=True)
    def _mapped_files(self) -> Iterator[None]:
        # Autouse fixtures run before the suite's adapter fixture, which calls make_config.
        self.directory = Path(tempfile.mkdtemp(prefix="lmcache-dax-suite-", dir="/dev/shm"))
        yield
        shutil.rmtree(self.directory, ignore_errors=True)

    def make_config(self) -> DaxConfig:
        return DaxConfig(
            device_path=str(self.directory / "dax0.img"), max_dax_size_gb=SIZE_GB, slot_bytes=SLOT
        )


class TestDaxTwoDevices(TestDaxFile):
    """Slots spread over two mappings of different sizes."""

    def make_config(self) -> DaxConfig:
        return DaxConfig(
            slot_bytes=SLOT,
            devices=(
                DaxDevice(device_path=str(self.directory / "dax0.img"), max_dax_size_gb=SIZE_GB / 2),
                DaxDevice(device_path=str(self.directory / "dax1.img"), max_dax_size_gb=SIZE_GB),
            ),
        )


class TestDaxFileWithSerde(TestDaxFile):
    serde = (DeflateSerde(),)

    def make_config(self) -> DaxConfig:
        # Slots with room for the frames, a little over the objects.
        slot = SLOT + 4096
        size_gb = (4096 + 64 * (4096 + slot)) / (1 << 30)
        return DaxConfig(
            device_path=str(self.directory / "dax0.img"), max_dax_size_gb=size_gb, slot_bytes=slot
        )
