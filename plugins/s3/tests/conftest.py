"""The S3 server every test of this plugin talks to: SeaweedFS on loopback, one per session;
an L1 to store from and load into, and the adapters a test opened, closed at its end."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import botocore.loaders
import botocore.session
import pytest

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.seaweedfs import SeaweedS3, serving

# Helper modules of these tests (imported by name under pytest's importlib mode).
sys.path.insert(0, str(Path(__file__).parent))

from s3_helpers import BUCKET

#: botocore's loader of service models, one per data path for every session these tests
#: make (see ``shared_service_models``)
_shared_loader = functools.lru_cache(maxsize=None)(botocore.loaders.create_loader)


@pytest.fixture(scope="module", autouse=True)
def shared_service_models() -> Iterator[None]:
    """Every botocore session of a module's tests reads the S3 service model once.

    Each adapter opens two sessions (its start-up probe's and its own), and a session's
    fresh loader parses the model's JSON again: about 0.3 s of CPU each, most of a test's
    time here.  The model is read-only data, the same for every session of a data path;
    credentials, profiles and config files are resolved per session as before."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(botocore.session, "create_loader", _shared_loader)
        yield


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
