"""The S3 server every test of this plugin talks to: SeaweedFS on loopback, one per session;
an L1 to store from and load into, the adapters a test opened, closed at its end, and an
adapter (with raw access to its objects) under the prefix a test module names in its
``prefix`` fixture."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.seaweedfs import SeaweedS3, serving

# Helper modules of these tests (imported by name under pytest's importlib mode).
sys.path.insert(0, str(Path(__file__).parent))

from s3_helpers import BUCKET, Raw, open_adapter, s3_config


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with serving(tmp_path_factory.mktemp("seaweedfs"), buckets=[BUCKET]) as server:
        yield server


@pytest.fixture
def l1() -> memoryview:
    return memoryview(bytearray(16 << 20))


@pytest.fixture
def opened() -> Iterator[list[L2Adapter]]:
    """The adapters a test opened, closed once it ends (however it ends)."""
    adapters: list[L2Adapter] = []
    yield adapters
    for adapter in adapters:
        adapter.close()


@pytest.fixture
def adapter(seaweed: SeaweedS3, prefix: str, l1: memoryview) -> Iterator[L2Adapter]:
    """An adapter on the bucket under the test module's ``prefix``, closed at the end."""
    adapter = open_adapter(s3_config(seaweed, prefix), l1)
    yield adapter
    adapter.close()


@pytest.fixture
def raw(seaweed: SeaweedS3, prefix: str) -> Raw:
    """The objects under the test module's ``prefix``, read and written past the adapter."""
    return Raw(seaweed, prefix)
