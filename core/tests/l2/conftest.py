from collections.abc import Iterator

import pytest

from lmcache_tiers.l2 import L2Adapter


@pytest.fixture
def adapters() -> Iterator[list[L2Adapter]]:
    """Adapters a test opened; all closed at teardown."""
    opened: list[L2Adapter] = []
    yield opened
    for adapter in opened:
        adapter.close()
