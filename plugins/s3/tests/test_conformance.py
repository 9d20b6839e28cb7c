"""``s3`` against the L2 adapter conformance suite, on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from lmcache_plugin_s3 import S3Config
from s3_helpers import blocking, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.plugin import BACKEND_FAILURES, CAPACITY, EVICTION, PERSISTENCE, L2Adapter, L2AdapterSuite
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.seaweedfs import SeaweedS3


class TestS3(L2AdapterSuite):
    """With max_capacity_gb > 0: usage is a fraction and a full adapter refuses stores."""

    component_name = "s3"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, BACKEND_FAILURES})

    @pytest.fixture(autouse=True)
    def _own_prefix(self, seaweed: SeaweedS3) -> None:
        # A fresh, empty storage per test: the shared bucket under a prefix of its own.
        self.server = seaweed
        self.prefix = fresh_prefix("conformance")

    @contextlib.contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        # Killed, the server refuses connections at once (no timeout to wait out); started
        # again on the same ports and directory, it serves what it had (as in test_outage).
        self.server.kill()
        try:
            yield
        finally:
            self.server.start()

    def make_config(self) -> S3Config:
        return s3_config(self.server, self.prefix, max_capacity_gb=1 / 4096)  # 256 KiB: 16 suite objects


def test_without_a_capacity_usage_is_unknown_and_nothing_is_refused(seaweed: SeaweedS3) -> None:
    l1 = memoryview(bytearray(4 << 20))
    adapter = open_adapter(s3_config(seaweed, fresh_prefix("no-capacity")), l1)
    try:
        keys = make_keys(3)
        assert blocking(adapter).store(keys, [l1[i << 20 : (i + 1) << 20] for i in range(3)]) == [True] * 3
        assert adapter.usage() == -1.0
        assert adapter.used_bytes() == 3 << 20, "bytes are counted all the same"
    finally:
        adapter.close()
