"""An ``eviction`` block without ``max_capacity_gb`` would never run (usage is -1 without
a capacity of the server's own): it is refused at its path, as the fs and mooncake
adapters refuse it, instead of a server that silently never evicts."""

from __future__ import annotations

import json

import pytest
from cli_config import print_config

EVICTION = {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}


@pytest.mark.parametrize("kind", ["redis", "resp", "valkey"])
def test_eviction_without_a_capacity_is_refused(kind: str) -> None:
    result = print_config({"type": kind, "host": "127.0.0.1", "port": 6379, "eviction": EVICTION})
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith(f"error: {kind}: L2 eviction needs max_capacity_gb > 0"), line
    assert line.endswith(" - at `$.l2_adapters[0].eviction`"), line


def test_eviction_with_a_capacity_is_accepted() -> None:
    adapter = {"type": "redis", "host": "127.0.0.1", "max_capacity_gb": 1, "eviction": EVICTION}
    result = print_config(adapter)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["l2_adapters"][0]["eviction"] == EVICTION
