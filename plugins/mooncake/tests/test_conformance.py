"""``mooncake_store`` against the L2 conformance suite, on a real master and segment host.

Objects live in the segment host's memory (the adapter lends none), so they outlive the
adapter that stored them: reopening finds them, and the master's key listing seeds the
accounting.  A second run has a serde chain, so that lookups of keys the adapter does not know
(after reopening) read the L1 size from the record header.
"""

from __future__ import annotations

import numpy as np
import pytest
from lmcache_plugin_mooncake import MooncakeStoreConfig
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import config_for

from lmcache_tiers.l2 import AdapterContext
from lmcache_tiers.plugin import CAPACITY, EVICTION, PERSISTENCE, L2AdapterConfig, L2AdapterSuite
from lmcache_tiers.serde import SerdeContext


class TestMooncakeStore(L2AdapterSuite):
    component_name = "mooncake_store"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_pool: LocalCluster) -> None:
        self.cluster = mooncake_pool

    def make_config(self) -> MooncakeStoreConfig:
        # 256 KiB: the capacity tests fill it with 16 objects of 16 KiB
        return config_for(self.cluster, max_capacity_gb=1 / 4096)


class Xor:
    """A size-preserving serde: with any chain configured, a lookup of a key the adapter
    does not know (after reopening) reads the record header for the L1 size."""

    name = "test-xor"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return (np.frombuffer(data, dtype=np.uint8) ^ 0x5A).tobytes()

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return (np.frombuffer(data, dtype=np.uint8) ^ 0x5A).tobytes()


class TestMooncakeStoreWithSerde(TestMooncakeStore):
    def make_context(self, config: L2AdapterConfig, l1_buffer: memoryview) -> AdapterContext:
        return AdapterContext(
            index=0, name="0:mooncake_store", config=config, serde=(Xor(),), l1_buffer=l1_buffer
        )
