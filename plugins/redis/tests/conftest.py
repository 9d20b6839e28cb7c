"""Real Redis servers for the tests: one standalone server and one 3-node cluster per session.

Each test names its objects under a key prefix of its own, so tests sharing a server never
see each other's objects.  Without redis-server (Debian package) the tests skip, saying so.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_redis.testing import RedisClusterNodes, RedisServer, missing_reason

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind

# Helper modules of these tests (imported by name under pytest's importlib mode).
sys.path.insert(0, str(Path(__file__).parent))


def _require_redis() -> None:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    _require_redis()
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def opened() -> Iterator[list[BackendAdapter]]:
    """Adapters a test opens, closed after it."""
    adapters: list[BackendAdapter] = []
    yield adapters
    for adapter in adapters:
        adapter.close()


@pytest.fixture
def open_adapter(opened: list[BackendAdapter]) -> Callable[..., BackendAdapter]:
    """Opens a ``redis`` adapter of the given fields, closed after the test."""

    def make(**fields: Any) -> BackendAdapter:
        registry = load_registry()
        spec = decode_adapter(registry, {"type": "redis", **fields}, 0)
        facts = AdapterContext(index=0, name="0:redis", config=spec.config)
        component = registry.get(Kind.L2_ADAPTER, "redis")
        adapter = create_adapter(component.load(), spec.config, facts, registry=registry, type_name="redis")
        assert isinstance(adapter, BackendAdapter)
        opened.append(adapter)
        return adapter

    return make
