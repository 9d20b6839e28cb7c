from collections.abc import Iterator

import pytest

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.threads import new_threads

__all__ = ["adapters", "new_threads"]


@pytest.fixture
def adapters() -> Iterator[list[L2Adapter]]:
    """Adapters a test opened; all closed at teardown."""
    opened: list[L2Adapter] = []
    yield opened
    for adapter in opened:
        adapter.close()
