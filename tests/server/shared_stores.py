"""The distributed stores the shared-L2 tests start once per module on loopback: each
starter skips (saying why) where its plugin or server is not installed, registers the
store's stop on ``stack`` and returns the adapter object the servers share (without
serde, capacity or namespace: each test adds its own) and the environment they need."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

#: an adapter object, and the environment the servers need to reach its store
SharedStore = tuple[dict[str, Any], dict[str, str]]


def redis_store(tmp_path: Path, stack: ExitStack) -> SharedStore:
    if importlib.util.find_spec("lmcache_plugin_redis") is None:
        pytest.skip("lmcache-plugin-redis is not installed")
    from lmcache_plugin_redis.testing import RedisServer, missing_reason

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    server = RedisServer(tmp_path / "redis").start()
    stack.callback(server.stop)
    return {"type": "redis", "url": server.url}, {}


def s3_store(tmp_path: Path, stack: ExitStack) -> SharedStore:
    if importlib.util.find_spec("lmcache_plugin_s3") is None:
        pytest.skip("lmcache-plugin-s3 is not installed")
    from lmcache_tiers.testing.seaweedfs import serving

    seaweed = stack.enter_context(serving(tmp_path / "seaweedfs", buckets=["shared"]))
    return {"type": "s3", "bucket": "shared", "endpoint_url": seaweed.endpoint}, seaweed.env


def mooncake_store(tmp_path: Path, stack: ExitStack) -> SharedStore:
    if importlib.util.find_spec("lmcache_plugin_mooncake") is None:
        pytest.skip("lmcache-plugin-mooncake is not installed")
    from lmcache_plugin_mooncake.cluster import LocalCluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = LocalCluster(tmp_path)
    stack.callback(cluster.stop)
    cluster.start()
    cluster.add_segment_host("256MB")
    # The servers' Mooncake clients use the loopback address.
    return cluster.adapter(), {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


STARTERS: dict[str, Callable[[Path, ExitStack], SharedStore]] = {
    "mooncake": mooncake_store,
    "redis": redis_store,
    "s3": s3_store,
}
