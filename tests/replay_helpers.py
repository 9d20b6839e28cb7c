"""Shared by the replay tests: the Mooncake trace, small traces, servers sized in blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "server"))  # tiers_e2e, the end-to-end server helpers

from tiers_e2e import ServerProcess, start_server  # noqa: E402

from lmcache_tiers.replay.capacity import l1_size_for_blocks  # noqa: E402

TRACE_ENV = "LMCACHE_TIERS_REPLAY_TRACE"
BLOCK_BYTES = 8192


def shared_trace() -> Path:
    """The shared Mooncake trace (``$LMCACHE_TIERS_REPLAY_TRACE`` or ``../shared/data``
    beside the repository); skips the test, saying why, when it is absent."""
    configured = os.environ.get(TRACE_ENV)
    path = (
        Path(configured)
        if configured
        else HERE.parent.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
    )
    if not path.is_file():
        reason = f"trace {path} is absent (set {TRACE_ENV} to its path)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return path


def small_trace(path: Path, requests: int = 60) -> Path:
    lines = []
    for index in range(requests):
        root = index % 5
        blocks = [root * 100 + depth for depth in range(1 + index % 7)] + [10_000 + index]
        lines.append(
            {
                "timestamp": index * 5,
                "input_length": 512 * len(blocks) - 7,
                "output_length": 2,
                "hash_ids": blocks,
            }
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def start_block_server(log_dir: Path, blocks: int, **config: Any) -> ServerProcess:
    """A server whose L1 holds exactly ``blocks`` replay blocks and never evicts in the
    background (watermark 1.0 on an arena never 100 % full)."""
    size_gb, align = l1_size_for_blocks(blocks, BLOCK_BYTES)
    settings: dict[str, Any] = {
        "l1_size_gb": size_gb,
        "l1_align_bytes": align,
        "eviction_trigger_watermark": 1.0,
        "eviction_policy": "LRU",
        **config,
    }
    return start_server(log_dir, metrics=False, **settings)


def output_of_killed(replay: subprocess.Popen[str]) -> str:
    """Kill a replay that never got where a test waited for it; what it printed, for the
    failure.  Its client processes may outlive it holding its pipes: then no output, rather
    than a read that waits for them."""
    replay.kill()
    try:
        return str(replay.communicate(timeout=10))
    except subprocess.TimeoutExpired:
        return "(no output: the replay's client processes still hold its pipes)"
