"""Replay on the shared Mooncake trace: the bounds are right and a real server matches the
simulation.  Skipped, with the reason printed, when the trace is absent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from replay_helpers import BLOCK_BYTES, shared_trace, start_block_server
from thirdparty import run_cli

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


@pytest.mark.parametrize("capacity", [1000, 4000, 16000])
def test_a_real_server_gives_the_exact_lru_hit_rate(
    trace: Path, simulation: dict[str, Any], tmp_path: Path, capacity: int
) -> None:
    simulated = next(p for p in simulation["points"] if p["capacity_blocks"] == capacity)
    expected = _runs(simulated)["exact LRU"]["hit_rate"]
    server = start_block_server(tmp_path / "server", capacity)
    try:
        args = ["replay", str(trace), "--url", server.url, "--block-bytes", str(BLOCK_BYTES), "--json"]
        result = run_cli(args)
        assert result.returncode == 0, result.stderr
        replayed = json.loads(result.stdout)
    finally:
        assert server.stop() == 0, server.output()
    assert replayed["corrupt_blocks"] == replayed["failed_requests"] == 0
    assert replayed["hit_blocks"] == replayed["l1_hit_blocks"]
    print(
        f"capacity {capacity}: server {replayed['hit_rate']['blocks']:.4f}, "
        f"simulated exact LRU {expected:.4f}"
    )
    assert abs(replayed["hit_rate"]["blocks"] - expected) <= 0.01
