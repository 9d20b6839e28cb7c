"""Replay on the shared Mooncake trace: the bounds are right and a real server matches the
simulation.  Skipped, with the reason printed, when the trace is absent."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from replay_helpers import BLOCK_BYTES, shared_trace, start_block_server
from thirdparty import launch_cli, run_cli
from tiers_e2e import ServerProcess

CAPACITIES = (1000, 4000, 16000, 64000)


@pytest.fixture(scope="module")
def trace() -> Path:
    return shared_trace()


@pytest.fixture(scope="module")
def simulation(trace: Path) -> dict[str, Any]:
    capacities = ",".join(str(capacity) for capacity in CAPACITIES)
    result = run_cli(["replay", str(trace), "--simulate", "--capacity", capacities, "--json"])
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def _independent_infinite_hit_rate(trace: Path) -> float:
    seen: set[int] = set()
    hits = total = 0
    for line in trace.read_text().splitlines():
        if not line.strip():
            continue
        blocks = json.loads(line)["hash_ids"]
        total += len(blocks)
        for block in blocks:
            if block not in seen:
                break
            hits += 1
        seen.update(blocks)
    return hits / total


def _runs(point: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {run["policy"]: run for run in point["runs"]}


def test_infinite_hit_rate_is_blocks_seen_before(trace: Path, simulation: dict[str, Any]) -> None:
    expected = _independent_infinite_hit_rate(trace)
    for point in simulation["points"]:
        assert _runs(point)["infinite"]["hit_rate"] == pytest.approx(expected, abs=1e-12)


def test_belady_beats_or_ties_every_policy_at_every_capacity(simulation: dict[str, Any]) -> None:
    assert simulation["trace"]["chain_conflicts"] == 0
    for point in simulation["points"]:
        runs = _runs(point)
        optimal = runs.pop("Belady")["hit_blocks"]
        unbounded = runs.pop("infinite")["hit_blocks"]
        assert optimal <= unbounded
        assert {"exact LRU", "LRU", "ARC", "S3FIFO", "PREFIX_LFU"} <= set(runs)
        for name, run in runs.items():
            assert run["hit_blocks"] <= optimal, f"{name} beat Belady at {point['capacity_blocks']} blocks"


#: the L1 capacities (blocks) a real server replays the trace at
SERVED = (1000, 4000, 16000)


@pytest.fixture(scope="module")
def replayed(
    trace: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, tuple[int, str, str, int, str]]:
    """The replay of the trace against a real server of each capacity in SERVED: the
    servers start together and the replays run side by side (each replay one client
    process of its own server, none sharing anything with another); per capacity, the
    replay's exit code, stdout and stderr, then the server's exit code and output."""
    root = tmp_path_factory.mktemp("servers")
    servers: dict[int, ServerProcess] = {}
    try:
        with ThreadPoolExecutor(len(SERVED)) as pool:
            starting = {
                capacity: pool.submit(start_block_server, root / str(capacity), capacity)
                for capacity in SERVED
            }
        failed = []
        for capacity, started in starting.items():  # every start has ended: each server is stopped below
            if started.exception() is None:
                servers[capacity] = started.result()
            else:
                failed.append(started.exception())
        if failed:
            raise failed[0]
        replays: dict[int, subprocess.Popen[str]] = {}
        try:
            for capacity, server in servers.items():
                args = [
                    "replay",
                    str(trace),
                    "--url",
                    server.url,
                    "--block-bytes",
                    str(BLOCK_BYTES),
                    "--json",
                ]
                replays[capacity] = launch_cli(args)
            outputs = {capacity: replay.communicate(timeout=600) for capacity, replay in replays.items()}
        finally:
            for replay in replays.values():  # those a failure left running
                replay.kill()
                replay.wait()
    finally:
        stopped = {capacity: server.stop() for capacity, server in servers.items()}
    return {
        capacity: (replays[capacity].returncode, out, err, stopped[capacity], servers[capacity].output())
        for capacity, (out, err) in outputs.items()
    }


@pytest.mark.parametrize("capacity", SERVED)
def test_a_real_server_gives_the_exact_lru_hit_rate(
    simulation: dict[str, Any], replayed: dict[int, tuple[int, str, str, int, str]], capacity: int
) -> None:
    simulated = next(p for p in simulation["points"] if p["capacity_blocks"] == capacity)
    expected = _runs(simulated)["exact LRU"]["hit_rate"]
    code, out, err, stop_code, server_output = replayed[capacity]
    assert code == 0, err
    assert stop_code == 0, server_output
    replayed_run = json.loads(out)
    assert replayed_run["corrupt_blocks"] == replayed_run["failed_requests"] == 0
    assert replayed_run["hit_blocks"] == replayed_run["l1_hit_blocks"]
    print(
        f"capacity {capacity}: server {replayed_run['hit_rate']['blocks']:.4f}, "
        f"simulated exact LRU {expected:.4f}"
    )
    assert abs(replayed_run["hit_rate"]["blocks"] - expected) <= 0.01
