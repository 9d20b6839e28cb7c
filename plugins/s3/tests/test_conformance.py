"""``s3`` against the L2 adapter conformance suite, on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import pytest
from lmcache_plugin_s3 import S3Config
from s3_helpers import fresh_prefix, s3_config

from lmcache_tiers.plugin import CAPACITY, EVICTION, PERSISTENCE, L2AdapterSuite
from lmcache_tiers.testing.seaweedfs import SeaweedS3


class TestS3(L2AdapterSuite):
    """No capacity: usage is -1.0 and nothing is refused for lack of room."""

    component_name = "s3"
    capabilities = frozenset({PERSISTENCE})
    capacity_gb = 0.0

    @pytest.fixture(autouse=True)
    def _own_prefix(self, seaweed: SeaweedS3) -> None:
        # A fresh, empty storage per test: the shared bucket under a prefix of its own.
        self.server = seaweed
        self.prefix = fresh_prefix("conformance")

    def make_config(self) -> S3Config:
        return s3_config(self.server, self.prefix, max_capacity_gb=self.capacity_gb)


class TestS3WithCapacity(TestS3):
    """max_capacity_gb > 0: usage is a fraction and a full adapter refuses stores."""

    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})
    capacity_gb = 1 / 4096  # 256 KiB: the capacity tests fill it with 16 KiB objects
