"""``mooncake_store`` against the L2 conformance suite, on a real master and segment host.

Objects live in the segment host's memory (the adapter lends none), so they outlive the
adapter that stored them: reopening finds them, and the master's key listing seeds the
accounting.  A second run has a serde chain, so that lookups of keys the adapter does not know
(after reopening) read the L1 size from the record header.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import pytest
from closing_in_turn import ClosingInTurn
from lmcache_plugin_mooncake import MooncakeStoreConfig
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import Xor, config_for

from lmcache_tiers.l2 import AdapterContext
from lmcache_tiers.plugin import (
    BACKEND_FAILURES,
    CAPACITY,
    EVICTION,
    PERSISTENCE,
    L2Adapter,
    L2AdapterConfig,
    L2AdapterSuite,
)
from lmcache_tiers.testing.processes import freeze


class TestMooncakeStore(L2AdapterSuite):
    component_name = "mooncake_store"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, BACKEND_FAILURES})

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_pool: LocalCluster, closing: ClosingInTurn) -> None:
        self.cluster = mooncake_pool
        self.closing = closing

    @pytest.fixture
    def opened(self, closing: ClosingInTurn, request: pytest.FixtureRequest) -> Iterator[list[L2Adapter]]:
        """Every adapter a test opened, closed after it with the next few tests' ones."""
        adapters: list[L2Adapter] = []
        yield adapters
        closing.done(adapters, request.node.nodeid)

    def open_adapter(self, config: L2AdapterConfig, l1_buffer: memoryview) -> L2Adapter:
        adapter = super().open_adapter(config, l1_buffer)
        self.closing.opened(adapter)
        return adapter

    @contextlib.contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        # The master frozen (SIGSTOP), not killed: objects do not survive a master restart.
        # Calls to it fail after the config's operation timeout (2 s).
        master = self.cluster.master
        assert master is not None
        freeze(master.pid)
        try:
            yield
        finally:
            master.send_signal(signal.SIGCONT)

    def make_config(self) -> MooncakeStoreConfig:
        # 256 KiB: the capacity tests fill it with 16 objects of 16 KiB
        return config_for(self.cluster, max_capacity_gb=1 / 4096)


class TestMooncakeStoreWithSerde(TestMooncakeStore):
    def make_context(self, config: L2AdapterConfig, l1_buffer: memoryview) -> AdapterContext:
        return AdapterContext(
            index=0, name="0:mooncake_store", config=config, serde=(Xor(),), l1_buffer=l1_buffer
        )
