"""The redis adapter against the L2 conformance suite, on a real server and a real cluster."""

from __future__ import annotations

import pytest
from lmcache_plugin_redis import RedisConfig
from lmcache_plugin_redis.testing import RedisClusterNodes, RedisServer

from lmcache_tiers.plugin import CAPACITY, EVICTION, PERSISTENCE, L2AdapterSuite

#: 256 KiB: the capacity tests fill it with 16 objects of the suite's 16 KiB
SMALL_GB = 1 / 4096


class TestRedisStandalone(L2AdapterSuite):
    component_name = "redis"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    @pytest.fixture(autouse=True)
    def _store(self, redis_server: RedisServer, prefix: str) -> None:
        self.url, self.prefix = redis_server.url, prefix

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
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    @pytest.fixture(autouse=True)
    def _store(self, redis_cluster: RedisClusterNodes, prefix: str) -> None:
        self.nodes, self.prefix = redis_cluster.startup_nodes, prefix

    def make_config(self) -> RedisConfig:
        return RedisConfig(
            startup_nodes=self.nodes, cluster_mode=True, key_prefix=self.prefix, max_capacity_gb=SMALL_GB
        )
