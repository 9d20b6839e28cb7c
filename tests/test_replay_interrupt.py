"""A replay through a server that is interrupted mid-request leaves no read locks behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from replay_helpers import BLOCK_BYTES, small_trace, start_block_server

from lmcache_tiers.client import Client
from lmcache_tiers.replay.run import ReplayOptions, ReplayTotals
from lmcache_tiers.replay.server import replay_share
from lmcache_tiers.replay.trace import read_trace


def _interrupt_after_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C arriving right after a LOOKUP answered with hits, before the RETRIEVE."""
    counted = ReplayTotals.count_request

    def count_then_interrupt(self: ReplayTotals, request: object, hits: int) -> None:
        counted(self, request, hits)  # type: ignore[arg-type]
        if hits:
            raise KeyboardInterrupt

    monkeypatch.setattr(ReplayTotals, "count_request", count_then_interrupt)


def test_an_interrupt_between_lookup_and_retrieve_gives_the_locks_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The LOOKUP read-locks the hit prefix for this client; left behind, those objects
    # stay pinned (unevictable) until the server's lock TTL, long after the replay ended.
    server = start_block_server(tmp_path / "server", 500)
    try:
        trace = read_trace(small_trace(tmp_path / "t.jsonl", requests=20))
        requests = list(enumerate(trace.requests))
        options = ReplayOptions(block_bytes=BLOCK_BYTES, timeout_s=10.0)
        origin = trace.requests[0].timestamp_ms
        replay_share(server.url, requests, options, origin_ms=origin, start=time.monotonic())
        _interrupt_after_a_hit(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            replay_share(server.url, requests, options, origin_ms=origin, start=time.monotonic())
        with Client(server.url, timeout=10.0) as probe:
            assert probe.status()["server"]["locked_keys"] == 0
    finally:
        assert server.stop() == 0, server.output()
