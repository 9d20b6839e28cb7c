"""Trace replay through a real server against the simulation, and the simulation's speed.

For each capacity C (in blocks) a server is started with an L1 of exactly C blocks that
never evicts in the background (trigger watermark 1.0 on an arena never 100 % full), the
trace is replayed through it with real bytes (``lmcache-tiers replay --url``), and its
prefix hit rate is printed next to the exact-LRU simulation of the same L1 and next to
Belady's optimum at that capacity -- the limit no policy can pass.

The simulation time of every installed policy over the whole trace is printed next to a
bare pass over the same block references (a set membership test per reference, as the
infinite cache does): the cost of replaying the trace at all, measured in the same run.
The replay's time per request is printed next to the server's PING round trip; a request
takes at least three (LOOKUP, RETRIEVE or STORE, RELEASE or COMMIT).  Policies run on
every LOOKUP inside the L1 lock, so the cost of ``on_keys_read`` per hit key is printed
for each policy next to ``LRU``'s, measured in the same run.

    python bench/bench_replay.py                          # the shared Mooncake trace
    python bench/bench_replay.py --trace my.jsonl --capacities 1000,4000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.replay.capacity import l1_size_for_blocks
from lmcache_tiers.replay.run import ReplayOptions
from lmcache_tiers.replay.server import replay_server
from lmcache_tiers.replay.simulate import EXACT_LRU, belady_run, policy_factories, simulate_policy
from lmcache_tiers.replay.trace import KeySpace, Trace, read_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = os.environ.get(
    "LMCACHE_TIERS_REPLAY_TRACE", str(ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl")
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class BlockServer:
    """``lmcache-tiers serve`` with an L1 of exactly ``blocks`` blocks, L1 only, LRU."""

    def __init__(self, blocks: int, block_bytes: int, workdir: Path) -> None:
        size_gb, align = l1_size_for_blocks(blocks, block_bytes)
        port = _free_port()
        self.url = f"tcp://127.0.0.1:{port}"
        config = workdir / f"l1-{blocks}.toml"
        config.write_text(
            f"l1_size_gb = {size_gb!r}\nl1_align_bytes = {align}\neviction_trigger_watermark = 1.0\n"
            f'eviction_policy = "LRU"\nport = {port}\nmetrics_port = 0\n'
        )
        self.log = (workdir / f"serve-{blocks}.log").open("wb")
        command = [
            sys.executable,
            "-m",
            "lmcache_tiers.cli.main",
            "serve",
            "--config",
            str(config),
            "--no-default-l2",
        ]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(self.url, timeout=0.5) as client:
                    client.ping()
                return
            except ClientError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the server for {blocks} blocks did not start (log: {self.log.name})"
                    ) from None

    def ping_us(self, count: int = 200) -> float:
        with Client(self.url) as client:
            return statistics.median(client.ping() for _ in range(count)) * 1e6

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        self.log.close()


def bare_pass_seconds(trace: Trace, repeats: int = 3) -> float:
    """A set membership test per block reference: the floor of any replay of the trace."""
    keys = [KeySpace().keys(request.hash_ids) for request in trace.requests]
    best = float("inf")
    for _ in range(repeats):
        seen: set[Any] = set()
        started = time.perf_counter()
        for request_keys in keys:
            for key in request_keys:
                if key not in seen:
                    seen.add(key)
        best = min(best, time.perf_counter() - started)
    return best


def read_cost_ns(factory: Any, prompts: int = 2000, length: int = 64, repeats: int = 3) -> float:
    """Nanoseconds per key of ``on_keys_read`` on prompts the policy holds (LOOKUP hits);
    a write between reads keeps policies that skip a repeated read honest."""
    policy = factory()
    space = KeySpace(model="bench-read-cost")
    batches = [space.keys(range(start * length, (start + 1) * length)) for start in range(prompts)]
    for batch in batches:
        policy.on_keys_written(batch)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for batch in batches:
            policy.on_keys_read(batch)
            policy.on_keys_written(batch[:1])
        best = min(best, time.perf_counter() - started)
    return best / (prompts * length) * 1e9


def run(trace_path: str, capacities: list[int], block_bytes: int) -> dict[str, Any]:
    trace = read_trace(trace_path)
    registry = load_registry()
    factories = policy_factories(registry)
    report: dict[str, Any] = {
        "trace": trace_path,
        "requests": len(trace.requests),
        "block_references": trace.block_references,
        "block_bytes": block_bytes,
        "capacities": [],
    }
    floor = bare_pass_seconds(trace)
    timing: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as workdir:
        for capacity in capacities:
            simulated = {
                name: simulate_policy(trace, name, factory, capacity) for name, factory in factories.items()
            }
            for name, result in simulated.items():
                timing.setdefault(name, []).append(result.seconds)
            optimal = belady_run(trace, capacity)
            timing.setdefault("Belady", []).append(optimal.seconds)
            server = BlockServer(capacity, block_bytes, Path(workdir))
            try:
                ping_us = server.ping_us()
                replayed = replay_server(server.url, trace, ReplayOptions(block_bytes=block_bytes)).to_dict()
            finally:
                server.stop()
            report["capacities"].append(
                {
                    "capacity_blocks": capacity,
                    "server_hit_rate": replayed["hit_rate"]["blocks"],
                    "simulated_exact_lru_hit_rate": simulated[EXACT_LRU].hit_rate,
                    "belady_hit_rate": optimal.hit_rate,
                    "policies_simulated": {name: result.hit_rate for name, result in simulated.items()},
                    "replay_seconds": replayed["seconds"],
                    "replay_us_per_request": replayed["seconds"] / max(1, replayed["requests"]) * 1e6,
                    "ping_us": ping_us,
                    "lookup_p50_ms": replayed["lookup_latency_ms"]["p50"],
                    "corrupt_blocks": replayed["corrupt_blocks"],
                }
            )
    report["bare_pass_seconds"] = floor
    report["simulation_seconds"] = {name: statistics.mean(values) for name, values in timing.items()}
    report["read_ns_per_key"] = {name: read_cost_ns(factory) for name, factory in factories.items()}
    return report


def show(report: dict[str, Any]) -> None:
    print(
        f"trace {report['trace']}: {report['requests']:,} requests, "
        f"{report['block_references']:,} block references"
    )
    print(
        f"{'capacity':>9}  {'server':>8}  {'sim LRU':>8}  {'diff pp':>8}  {'Belady':>8}  "
        f"{'us/req':>8}  {'ping us':>8}"
    )
    for point in report["capacities"]:
        diff = (point["server_hit_rate"] - point["simulated_exact_lru_hit_rate"]) * 100
        print(
            f"{point['capacity_blocks']:>9,}  {point['server_hit_rate']:>8.4f}  "
            f"{point['simulated_exact_lru_hit_rate']:>8.4f}  {diff:>+8.2f}  "
            f"{point['belady_hit_rate']:>8.4f}  "
            f"{point['replay_us_per_request']:>8.0f}  {point['ping_us']:>8.0f}"
        )
    floor = report["bare_pass_seconds"]
    print(
        f"simulation time per run (mean over capacities) vs a bare pass over the references ({floor:.3f} s):"
    )
    for name, seconds in report["simulation_seconds"].items():
        rate = report["block_references"] / seconds if seconds else float("inf")
        print(f"  {name:<12} {seconds:7.3f} s  {rate:>12,.0f} refs/s  {seconds / floor:6.1f}x the bare pass")
    costs = report["read_ns_per_key"]
    lru = costs.get("LRU") or costs.get("exact LRU")
    print("on_keys_read per hit key (64-key prompts), next to LRU's:")
    for name, cost in costs.items():
        print(f"  {name:<12} {cost:7.0f} ns  {cost / lru:6.2f}x LRU")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake trace (default: the shared one)")
    parser.add_argument("--capacities", default="1000,4000,16000", help="L1 capacities in blocks")
    parser.add_argument("--block-bytes", type=int, default=8192)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        sys.exit(f"trace {args.trace} not found: pass --trace or set LMCACHE_TIERS_REPLAY_TRACE")
    capacities = [int(part) for part in args.capacities.split(",") if part.strip()]
    report = run(args.trace, capacities, args.block_bytes)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        show(report)


if __name__ == "__main__":
    main()
