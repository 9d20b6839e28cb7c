"""fs against the L2 adapter conformance suite: a local directory (flat, sharded, with
O_DIRECT and a temp directory), which the failure test makes fail for real, and fsspec's
memory://."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from lmcache_plugin_fs import FsConfig

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.files import ScratchDirectory, directory_replaced_by_file
from lmcache_tiers.testing.l2 import (
    BACKEND_FAILURES,
    CAPACITY,
    EVICTION,
    IMMEDIATE_MISSES,
    PERSISTENCE,
    DeflateSerde,
    L2AdapterSuite,
)

#: 2 MiB: 128 objects of the suite's 16 KiB before stores are refused
SUITE_CAPACITY_GB = 2 / 1024


class FailingLocalDirectory(ScratchDirectory):
    """The local directory fails for real: a regular file stands at its path (ENOTDIR
    below it), the directory itself put back afterwards."""

    @contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        with directory_replaced_by_file(self.storage_dir):
            yield


class TestFsLocal(FailingLocalDirectory, L2AdapterSuite):
    component_name = "fs"
    # misses are told from memory; a hit is confirmed by its record file
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, IMMEDIATE_MISSES, BACKEND_FAILURES})

    def make_config(self) -> FsConfig:
        return FsConfig(path=self.storage_dir, max_capacity_gb=SUITE_CAPACITY_GB)


class TestFsLocalSharded(TestFsLocal):
    def make_config(self) -> FsConfig:
        return FsConfig(base_path=self.storage_dir, max_capacity_gb=SUITE_CAPACITY_GB, shard_dirs=True)


class TestFsLocalDirect(TestFsLocal):
    def make_config(self) -> FsConfig:
        return FsConfig(
            path=self.storage_dir, max_capacity_gb=SUITE_CAPACITY_GB, use_odirect=True, relative_tmp_dir="tmp"
        )


class TestFsLocalWithSerde(TestFsLocal):
    """Records whose payloads are not their objects' sizes, as a compressing chain writes."""

    serde = (DeflateSerde(),)


class TestFsUnbounded(FailingLocalDirectory, L2AdapterSuite):
    component_name = "fs"
    capabilities = frozenset({PERSISTENCE, IMMEDIATE_MISSES, BACKEND_FAILURES})

    def make_config(self) -> FsConfig:
        return FsConfig(path=f"file://{self.storage_dir}")


class TestFsMemory(L2AdapterSuite):
    component_name = "fs"
    # no BACKEND_FAILURES: fsspec's memory store has nothing that can fail
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    @pytest.fixture(autouse=True)
    def _namespace(self) -> Iterator[None]:
        self.url = f"memory://lmcache-fs-suite-{uuid.uuid4().hex}"
        yield
        import fsspec

        memory = fsspec.filesystem("memory")
        if memory.exists(self.url):
            memory.rm(self.url, recursive=True)

    def make_config(self) -> FsConfig:
        return FsConfig(path=self.url, max_capacity_gb=SUITE_CAPACITY_GB, shard_dirs=True)


class TestFsMemoryWithSerde(TestFsMemory):
    serde = (DeflateSerde(),)
