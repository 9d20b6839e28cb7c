"""The redis adapter against the L2 conformance suite, on a real server and a real cluster."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from lmcache_plugin_redis import RedisConfig
from lmcache_plugin_redis.testing import RedisClusterNodes, RedisServer

from lmcache_tiers.plugin import BACKEND_FAILURES, CAPACITY, EVICTION, PERSISTENCE, L2Adapter, L2AdapterSuite

#: 256 KiB: the capacity tests fill it with 16 objects of the suite's 16 KiB
SMALL_GB = 1 / 4096
#: how long restarted cluster nodes may take to agree the cluster is whole again
CLUSTER_OK_TIMEOUT_S = 60.0


@contextlib.contextmanager
def servers_down(servers: list[RedisServer]) -> Iterator[None]:
    """The servers killed (connections refused, as after a crash) and started again on
    their ports with their data.  The test servers save nothing by themselves, so each
    writes a snapshot first, which it loads when it starts again."""
    for server in servers:
        server.cli("SAVE")
    for server in servers:
        server.stop()
    try:
        yield
    finally:
        for server in servers:
            server.start()


def wait_cluster_ok(nodes: list[RedisServer]) -> None:
    deadline = time.monotonic() + CLUSTER_OK_TIMEOUT_S
    while not all("cluster_state:ok" in node.cli("CLUSTER", "INFO").stdout for node in nodes):
        assert time.monotonic() < deadline, "the restarted cluster never reported cluster_state:ok"
        time.sleep(0.05)


class TestRedisStandalone(L2AdapterSuite):
    component_name = "redis"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, BACKEND_FAILURES})

    @pytest.fixture(autouse=True)
    def _store(self, redis_server: RedisServer, prefix: str) -> None:
        self.server, self.url, self.prefix = redis_server, redis_server.url, prefix

    @contextlib.contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        with servers_down([self.server]):
            yield

    def make_config(self) -> RedisConfig:
        return RedisConfig(url=self.url, key_prefix=self.prefix, max_capacity_gb=SMALL_GB)


class TestRedisWithoutCapacity(L2AdapterSuite):
    """max_capacity_gb 0: the store's own memory limit applies; usage is -1."""

    component_name = "redis"
    capabilities = frozenset({PERSISTENCE})

    @pytest.fixture(autouse=True)
    def _store(self, redis_server: RedisServer, prefix: str) -> None:
        self.host, self.port, self.prefix = "127.0.0.1", redis_server.port, prefix

    def make_config(self) -> RedisConfig:
        return RedisConfig(host=self.host, port=self.port, key_prefix=self.prefix)


class TestRedisCluster(L2AdapterSuite):
    component_name = "redis"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION, BACKEND_FAILURES})

    @pytest.fixture(autouse=True)
    def _store(self, redis_cluster: RedisClusterNodes, prefix: str) -> None:
        self.cluster, self.nodes, self.prefix = redis_cluster, redis_cluster.startup_nodes, prefix

    @contextlib.contextmanager
    def failing_storage(self, adapter: L2Adapter) -> Iterator[None]:
        # Every node down: each key's node refuses, whichever slot it hashed to.  Restarted,
        # the nodes keep their ids and slots (nodes.conf) and their keys (the snapshot).
        # Whole again even when the test failed inside: the session's later tests use it.
        try:
            with servers_down(self.cluster.nodes):
                yield
        finally:
            wait_cluster_ok(self.cluster.nodes)

    def make_config(self) -> RedisConfig:
        return RedisConfig(
            startup_nodes=self.nodes, cluster_mode=True, key_prefix=self.prefix, max_capacity_gb=SMALL_GB
        )
