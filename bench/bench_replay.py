"""Eviction policies on a trace next to their limits, and replay through a real server.

The policy study simulates every installed eviction policy at 1k, 4k, 16k and 64k blocks
next to exact LRU and Belady's optimum (the limit no policy can pass), and prints the share
of the LRU -> Belady gap each one closes.  So that a gain is not a coincidence of one file,
the same is done on the trace's first and second halves (each replayed from a cold cache)
and on re-timed samples of its Poisson model (``replay --simulate --retime``), where the
bound no online policy can beat in expectation and a policy told the true rates are printed
beside the policies.  A ladder of next-use oracles with growing foresight (``--foresight``)
shows how far ahead a policy would have to see to close a given share of the gap.

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
    python bench/bench_replay.py --no-server --seeds 5    # the policy study only
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_args import BenchParser, at_least_one, whole_number_from

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.replay.capacity import l1_size_for_blocks
from lmcache_tiers.replay.foresight import foresight_factories
from lmcache_tiers.replay.report import gap_closed, gap_share
from lmcache_tiers.replay.retime import RATE_ORACLE, RateOracle, best_bandwidth, fit_rates, rate_bound, retime
from lmcache_tiers.replay.run import ReplayOptions
from lmcache_tiers.replay.server import replay_server
from lmcache_tiers.replay.simulate import (
    BELADY,
    EXACT_LRU,
    INFINITE,
    CapacityPoint,
    belady_run,
    policy_factories,
    simulate_curve,
    simulate_policy,
)
from lmcache_tiers.replay.trace import KeySpace, Trace, TraceError, read_trace
from lmcache_tiers.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = os.environ.get(
    "LMCACHE_TIERS_REPLAY_TRACE", str(ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl")
)


class BlockServer:
    """``lmcache-tiers serve`` with an L1 of exactly ``blocks`` blocks, L1 only, LRU."""

    def __init__(self, blocks: int, block_bytes: int, workdir: Path) -> None:
        size_gb, align = l1_size_for_blocks(blocks, block_bytes)
        port = free_port()
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


def trace_read_cost_ns(trace: Trace, factory: Any, capacity: int) -> float:
    """Nanoseconds per key of ``on_keys_read`` while the trace is simulated: the real mix of
    LOOKUP sizes and hit patterns (the timer's own cost is in every policy's figure)."""
    policy = factory()
    read = policy.on_keys_read
    spent, keys = 0.0, 0

    def timed(batch: Any) -> None:
        nonlocal spent, keys
        started = time.perf_counter()
        read(batch)
        spent += time.perf_counter() - started
        keys += len(batch)

    policy.on_keys_read = timed
    simulate_policy(trace, "timed", lambda: policy, capacity)
    return spent / max(1, keys) * 1e9


def _point_summary(point: CapacityPoint) -> dict[str, Any]:
    return {
        "capacity_blocks": point.capacity_blocks,
        "miss_ratio": {run.policy: run.miss_ratio for run in point.runs},
        "gap_closed": {
            run.policy: gap_closed(point, run.policy)
            for run in point.runs
            if run.policy not in (EXACT_LRU, BELADY, INFINITE)
        },
        "seconds": {run.policy: run.seconds for run in point.runs},
    }


def _halves(trace: Trace) -> list[tuple[str, Trace]]:
    middle = len(trace.requests) // 2
    return [
        ("first half", Trace(f"{trace.path} (first half)", trace.requests[:middle])),
        ("second half", Trace(f"{trace.path} (second half)", trace.requests[middle:])),
    ]


def policy_study(
    trace: Trace, capacities: list[int], small: list[int], seeds: int, horizons: list[int | None]
) -> dict[str, Any]:
    """Every policy next to exact LRU and Belady on the trace, its halves and re-timed samples."""
    factories = policy_factories(load_registry())
    study: dict[str, Any] = {
        "whole": [_point_summary(p) for p in simulate_curve(trace, factories, capacities)]
    }
    study["halves"] = {
        label: [_point_summary(p) for p in simulate_curve(half, factories, small)]
        for label, half in _halves(trace)
    }
    bandwidth = best_bandwidth(trace)
    model = fit_rates(trace, float(bandwidth))
    samples = []
    for seed in range(seeds):
        sample = retime(trace, float(bandwidth), seed, model)
        with_oracle = {**factories, RATE_ORACLE: lambda sample=sample: RateOracle(sample)}
        points = simulate_curve(sample.trace, with_oracle, [*small, 16000])
        bounds = rate_bound(sample, [p.capacity_blocks for p in points], trace.block_references)
        summaries = []
        for point in points:
            summary = _point_summary(point)
            summary["online_bound_hit_rate"] = bounds[point.capacity_blocks]
            summary["online_bound_gap_closed"] = gap_share(point, bounds[point.capacity_blocks])
            summaries.append(summary)
        samples.append({"seed": seed, "points": summaries})
    study["retimed"] = {"bandwidth_requests": bandwidth, "samples": samples}
    ladder = []
    for capacity in small:
        lru = simulate_policy(trace, EXACT_LRU, factories[EXACT_LRU], capacity).hit_rate
        optimal = belady_run(trace, capacity).hit_rate
        row: dict[str, Any] = {
            "capacity_blocks": capacity,
            "exact_lru": lru,
            "belady": optimal,
            "oracles": {},
        }
        for name, factory in foresight_factories(trace, horizons).items():
            hit = simulate_policy(trace, name, factory, capacity).hit_rate
            # No gap (LRU already optimal at this capacity): no share of it, as gap_share says.
            closed = (hit - lru) / (optimal - lru) if optimal - lru > 1e-12 else None
            row["oracles"][name] = {"hit_rate": hit, "gap_closed": closed}
        ladder.append(row)
    study["foresight"] = ladder
    return study


def run(
    trace_path: str,
    capacities: list[int],
    block_bytes: int,
    *,
    server: bool = True,
    seeds: int = 3,
    study_capacities: list[int] | None = None,
) -> dict[str, Any]:
    trace = read_trace(trace_path)
    registry = load_registry()
    factories = policy_factories(registry)
    sizes = study_capacities or [1000, 4000, 16000, 64000]
    small = [size for size in sizes if size <= 4000] or sizes[:1]
    report: dict[str, Any] = {
        "trace": trace_path,
        "requests": len(trace.requests),
        "block_references": trace.block_references,
        "block_bytes": block_bytes,
        "capacities": [],
        "study": policy_study(trace, sizes, small, seeds, [0, 10, 30, 100, 300, None]),
    }
    floor = bare_pass_seconds(trace)
    timing: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as workdir:
        for capacity in capacities if server else []:
            simulated = {
                name: simulate_policy(trace, name, factory, capacity) for name, factory in factories.items()
            }
            for name, result in simulated.items():
                timing.setdefault(name, []).append(result.seconds)
            optimal = belady_run(trace, capacity)
            timing.setdefault("Belady", []).append(optimal.seconds)
            block_server = BlockServer(capacity, block_bytes, Path(workdir))
            try:
                ping_us = block_server.ping_us()
                replayed = replay_server(
                    block_server.url, trace, ReplayOptions(block_bytes=block_bytes)
                ).to_dict()
            finally:
                block_server.stop()
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
    if not timing:
        for point in report["study"]["whole"]:
            for name, seconds in point["seconds"].items():
                if name != INFINITE:
                    timing.setdefault(name, []).append(seconds)
    report["bare_pass_seconds"] = floor
    report["simulation_seconds"] = {name: statistics.mean(values) for name, values in timing.items()}
    report["read_ns_per_key"] = {name: read_cost_ns(factory) for name, factory in factories.items()}
    report["trace_read_ns_per_key"] = {
        name: trace_read_cost_ns(trace, factory, small[-1]) for name, factory in factories.items()
    }
    return report


def _share(value: float | None) -> str:
    return "     -" if value is None else f"{value * 100:+6.1f}%"


def _miss_table(points: list[dict[str, Any]], title: str) -> None:
    names = list(points[0]["miss_ratio"])
    width = max(10, *(len(name) for name in names))
    print(title)
    print(f"{'blocks':>8}  " + "  ".join(f"{name:>{width}}" for name in names))
    for point in points:
        cells = "  ".join(f"{point['miss_ratio'][name]:>{width}.4f}" for name in names)
        print(f"{point['capacity_blocks']:>8,}  {cells}")


def _gap_table(rows: list[tuple[str, dict[str, float | None]]], title: str) -> None:
    if not rows:  # e.g. --seeds 0: no re-timed sample to show
        return
    names = list(rows[0][1])
    width = max(10, *(len(name) for name in names))
    label = max(8, *(len(text) for text, _ in rows))
    print(title)
    print(f"{'':>{label}}  " + "  ".join(f"{name:>{width}}" for name in names))
    for text, shares in rows:
        print(f"{text:>{label}}  " + "  ".join(f"{_share(shares[name]):>{width}}" for name in names))


def show_study(study: dict[str, Any]) -> None:
    whole = study["whole"]
    _miss_table(
        whole, "miss ratio on the whole trace (exact LRU, every installed policy, Belady = the limit)"
    )
    _gap_table(
        [(f"{p['capacity_blocks']:,}", p["gap_closed"]) for p in whole],
        "share of the exact-LRU -> Belady gap closed, whole trace",
    )
    rows = [
        (f"{label} {p['capacity_blocks']:,}", p["gap_closed"])
        for label, points in study["halves"].items()
        for p in points
    ]
    _gap_table(rows, "the same on each half of the trace, replayed from a cold cache")
    retimed = study["retimed"]
    rows = []
    for sample in retimed["samples"]:
        for point in sample["points"]:
            shares = {**point["gap_closed"], "online bound": point["online_bound_gap_closed"]}
            rows.append((f"seed {sample['seed']} {point['capacity_blocks']:,}", shares))
    _gap_table(
        rows,
        f"re-timed samples (Poisson model, bandwidth {retimed['bandwidth_requests']} requests): "
        "policies, the rate oracle and the bound no online policy beats in expectation",
    )
    print("next-use oracles through the server's eviction rules: share of the gap vs foresight (requests)")
    for row in study["foresight"]:
        cells = ", ".join(
            f"{name}: {_share(value['gap_closed']).strip()}" for name, value in row["oracles"].items()
        )
        print(f"  {row['capacity_blocks']:>6,} blocks  {cells}")


def show(report: dict[str, Any]) -> None:
    print(
        f"trace {report['trace']}: {report['requests']:,} requests, "
        f"{report['block_references']:,} block references"
    )
    show_study(report["study"])
    if report["capacities"]:
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
    costs, traced = report["read_ns_per_key"], report["trace_read_ns_per_key"]
    lru, traced_lru = costs.get("LRU") or costs["exact LRU"], traced.get("LRU") or traced["exact LRU"]
    print("on_keys_read per hit key, next to LRU's: 64-key prompts | during the trace simulation")
    for name, cost in costs.items():
        print(
            f"  {name:<12} {cost:7.0f} ns  {cost / lru:5.2f}x LRU  |  "
            f"{traced[name]:6.0f} ns  {traced[name] / traced_lru:5.2f}x LRU"
        )


def block_counts(text: str) -> list[int]:
    """An argparse ``type`` for capacities in blocks given as ``1000,4000``: a capacity of no
    block is no cache to measure, and a typo must not end the run in a traceback."""
    return [at_least_one(part.strip()) for part in text.split(",") if part.strip()]


#: ``--block-bytes``: at least 128, as ``replay`` requires
block_bytes = whole_number_from(128)
#: ``--seeds``: 0 skips the re-timed samples; fewer is a typo
seed_count = whole_number_from(0)


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake trace")
    parser.add_argument(
        "--capacities", type=block_counts, default="1000,4000,16000", help="server L1 capacities in blocks"
    )
    parser.add_argument(
        "--study-capacities",
        type=block_counts,
        default="1000,4000,16000,64000",
        help="simulated capacities of the policy study",
    )
    parser.add_argument("--seeds", type=seed_count, default=3, help="re-timed samples in the policy study")
    parser.add_argument("--no-server", action="store_true", help="skip the replays through a real server")
    parser.add_argument("--block-bytes", type=block_bytes, default=8192, help="bytes per replayed block")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        sys.exit(f"trace {args.trace} not found: pass --trace or set LMCACHE_TIERS_REPLAY_TRACE")
    try:
        report = run(
            args.trace,
            args.capacities,
            args.block_bytes,
            server=not args.no_server,
            seeds=args.seeds,
            study_capacities=args.study_capacities,
        )
    except TraceError as exc:
        # The line that names the file and its bad line, as ``lmcache-tiers replay`` says it.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        show(report)


if __name__ == "__main__":
    main()
