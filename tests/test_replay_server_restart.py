"""A server that restarts during a replay through it: its counters before and after are two
processes', and their difference is none of the replay's figures."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from replay_helpers import BLOCK_BYTES, small_trace, start_block_server
from thirdparty import run_cli_in_process
from tiers_e2e import ServerProcess


def test_a_server_restarted_mid_replay_gives_no_counters_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client follows a server that restarts at its address, so the replay ran to its
    end; the L1/L2 split and the evictions were the new server's counters minus the old
    one's: negative after a busy first life (-1,200 L1 hit blocks), short otherwise."""
    from lmcache_tiers.replay import server as server_replay

    servers: list[ServerProcess] = [start_block_server(tmp_path / "first", 40)]
    port = int(servers[0].url.rsplit(":", 1)[1])
    trace = str(small_trace(tmp_path / "t.jsonl", requests=60))
    args = ["replay", trace, "--url", servers[0].url, "--block-bytes", str(BLOCK_BYTES), "--json"]
    replay_share = server_replay.replay_share

    def restart_halfway(url: str, requests: Any, *rest: Any, **kwargs: Any) -> Any:
        half = len(requests) // 2
        replay_share(url, requests[:half], *rest, **kwargs)
        servers[-1].stop()
        servers.append(start_block_server(tmp_path / "second", 40, port=port))
        return replay_share(url, requests[half:], *rest, **kwargs)

    try:
        for _ in range(20):  # a busy first life: its counters run far ahead of the second's
            warm_up = run_cli_in_process(args)
            assert warm_up.returncode == 0, warm_up.stderr
        monkeypatch.setattr(server_replay, "replay_share", restart_halfway)
        result = run_cli_in_process(args)
    finally:
        for server in servers:
            server.stop(signal.SIGKILL)
    assert len(servers) == 2, result.stderr
    document = json.loads(result.stdout)
    assert document["requests"] == 60 and document["failed_requests"] == 0
    assert document["hit_blocks"] > 0  # the replay's own figures stand
    # what only the server counts is unknown, not the difference of two processes' counters
    assert document["l1_hit_blocks"] is None and document["l2_hit_blocks"] is None
    assert document["evicted_blocks"] == {"l1": None, "l2": None}
    assert document["hit_rate"]["l1_blocks"] is None and document["server_failures"] is None
    assert "restarted" in document["stopped"]
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: the replay ran its 60 requests but the server's counters could not be read"
    )
    assert "restarted" in line
