"""LMCache's own client against LMCache's server and against lmcache-tiers, side by side.

``lmcache bench server --mode cpu`` (LMCache 0.5.6, from the reference venv that
scripts/install_reference_lmcache.sh fills) runs against

* LMCache's ``lmcache server`` in SHM mode (``--supported-transfer-mode auto``), and
* ``lmcache-tiers serve --frontend '{"type": "lmcache_mp"}'``,

first with L1 only, then with a file L2 (LMCache's ``fs`` adapter; lmcache-tiers' ``fs``,
or ``nixl_store_dynamic`` on NIXL's POSIX backend with ``--tiers-l2 nixl``; with
``--direct`` both servers' file L2s use O_DIRECT), in the same directory tree, same L1 size,
same KV layout (``--shape-spec``), requests of ``--tokens`` tokens.  Both servers of a
configuration run side by side (idle, each costs nothing) and the client runs against them
in turn, ``--requests-per-slice`` requests at a time, ``--slices`` times each, so a burst
of load from elsewhere on the machine falls on both alike; every slice uses requests (token
sequences) of its own, so cold passes are cold.  The p50 and p99 of each figure are over
all the requests of all slices (the client prints one line per operation).  The default,
128 requests, makes a p99 the second or third slowest of its figure's samples: with 16, a
p99 is the slowest, and one scheduling stall of the machine (below) decides it.  The
requests pass 4 GiB, twice the default L1, so the later slices run with a full L1, as a
server in service does.

Next to the figures, the limits measured in the same run: a memcpy of one request's KV
bytes (a store or a retrieve copies them once between the engine's blocks and the L1
segment, on the client), and two bare ZeroMQ round trips (a lookup is the LOOKUP request
and its first status query).  A third process only sleeps 2 ms at a time during the run
and reports how late it woke up: on a shared machine the longest of those delays is a
floor under every p99 (a request that arrives while its server is off the CPU waits as
long), whatever the server does.  Target: lmcache-tiers faster on every figure, and lookups
under 3 ms p99 with the L2 configured.

    python bench/bench_lmcache_mp.py                   # 8 slices of 16 requests x 1024 tokens each
    python bench/bench_lmcache_mp.py --slices 16 --json
    python bench/bench_lmcache_mp.py --slices 16 --systems tiers --configs l2   # the L2 lookup bar alone
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).parent))
from bench_args import BenchParser
from bench_server import free_port, measure_floor, run_bench_keys
from run_all import interruptible

CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
REF_VENV = Path(os.environ.get("LMCACHE_REF_VENV", CACHE_HOME / "lmcache-tiers" / "lmcache-0.5.6"))
REF_ENV = {"DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
LOOKUP_P99_TARGET_MS = 3.0
#: figure -> (pass, operation) in the client's lines: "[seq 3/warm] LOOKUP: 4/4 chunks hit (0.6 ms)"
FIGURES = {
    "store": ("cold", "STORE"),  # prepare_store, gather into L1, commit_store
    "retrieve": ("warm", "RETRIEVE"),  # prepare_retrieve, scatter from L1, commit_retrieve
    "lookup (miss)": ("cold", "LOOKUP"),  # lookup, then status queries until the answer
    "lookup (hit)": ("warm", "LOOKUP"),
}
_LINE = re.compile(r"\[seq (\d+)/(cold|warm)\] (LOOKUP|STORE|RETRIEVE): .*?([\d.]+) ms")


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    """Until the server answers LMCache's noop (both servers speak the protocol)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    deadline = time.monotonic() + timeout
    try:
        uid = 0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode} while starting")
            sock.send_multipart([msgspec.msgpack.encode(uid), msgspec.msgpack.encode(24)])
            if sock.poll(1000):
                sock.recv_multipart()
                return
            uid += 1
        raise SystemExit(f"no server answered on {url} within {timeout:g}s")
    finally:
        sock.close(0)
        context.term()


def start_reference(
    port: int, l2_dir: Path | None, l1_gb: int, logs: Path, direct: bool = False
) -> subprocess.Popen[bytes]:
    command = [
        str(REF_VENV / "bin" / "lmcache"),
        *("server", "--host", "127.0.0.1", "--port", str(port)),
        *("--http-host", "127.0.0.1", "--http-port", str(free_port())),
        *("--l1-size-gb", str(l1_gb), "--l1-init-size-gb", str(l1_gb), "--eviction-policy", "LRU"),
        *("--supported-transfer-mode", "auto", "--shm-name", f"bench{os.getpid()}", "--disable-metrics"),
    ]
    if l2_dir is not None:
        adapter = {"type": "fs", "base_path": str(l2_dir), **({"use_odirect": True} if direct else {})}
        command += ["--l2-adapter", json.dumps(adapter)]
    return subprocess.Popen(
        command,
        stdout=(logs / "reference.log").open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **REF_ENV},
    )


def start_tiers(
    port: int, l2_dir: Path | None, l1_gb: int, logs: Path, l2_type: str = "fs", direct: bool = False
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        *("-m", "lmcache_tiers.cli.main", "serve", "--no-default-l2", "--l1-size-gb", str(l1_gb)),
        *("--port", str(port), "--metrics-port", "0", "--frontend", '{"type": "lmcache_mp"}'),
    ]
    if l2_dir is not None:
        adapter: dict[str, Any] = {
            "type": "fs",
            "path": str(l2_dir),
            "max_capacity_gb": 8,
            "use_odirect": direct,
        }
        if l2_type == "nixl":
            params = {"file_path": str(l2_dir), "use_direct_io": str(direct).lower(), "max_capacity_gb": "8"}
            adapter = {"type": "nixl_store_dynamic", "backend": "POSIX", "backend_params": params}
        command += ["--l2-adapter", json.dumps(adapter)]
    # SIGINT at its default action: serve keeps an inherited ignored SIGINT (this benchmark
    # run as a script's background job), and stop() would then wait a minute and kill it.
    return subprocess.Popen(
        command, stdout=(logs / "tiers.log").open("ab"), stderr=subprocess.STDOUT, preexec_fn=interruptible
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_client(
    url: str, args: argparse.Namespace, first: int, count: int, output: Path
) -> tuple[dict[str, Any], str]:
    """The client's JSON metrics and its log for requests ``first .. first + count - 1``."""
    command = [
        str(REF_VENV / "bin" / "lmcache"),
        *("bench", "server", "--rpc-url", url, "--mode", "cpu", "--interval", "0"),
        *("--start", str(first), "--end", str(first + count), "--num-tokens", str(args.tokens)),
        *("--kvcache-shape-spec", args.shape_spec, "--format", "json", "--output", str(output)),
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, **REF_ENV},
        cwd=output.parent,
    )
    if done.returncode != 0 or not output.exists():
        raise SystemExit(f"the LMCache client failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    metrics: dict[str, Any] = json.loads(output.read_text())["metrics"]
    output.unlink()
    return metrics, done.stdout


def samples_of(log: str, skip_seq: int | None = None) -> dict[str, list[float]]:
    """Every operation's latency in ms, by figure (but request ``skip_seq``'s)."""
    found: dict[str, list[float]] = {name: [] for name in FIGURES}
    wanted = {where: name for name, where in FIGURES.items()}
    for match in _LINE.finditer(log):
        if skip_seq is not None and int(match.group(1)) == skip_seq:
            continue
        name = wanted.get((match.group(2), match.group(3)))
        if name is not None:
            found[name].append(float(match.group(4)))
    return found


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def start_both(
    with_l2: bool, args: argparse.Namespace, work: Path, systems: list[str]
) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
    """The servers of one configuration, listening: system -> (process, URL)."""
    running: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    starters = {
        "reference": functools.partial(start_reference, direct=args.direct),
        "tiers": functools.partial(start_tiers, l2_type=args.tiers_l2, direct=args.direct),
    }
    try:
        for system in systems:
            start = starters[system]
            l2_dir = work / f"l2-{system}" if with_l2 else None
            if l2_dir is not None:
                shutil.rmtree(l2_dir, ignore_errors=True)
                l2_dir.mkdir(parents=True)
            port = free_port()
            proc = start(port, l2_dir, args.l1_size_gb, work)
            running[system] = (proc, f"tcp://127.0.0.1:{port}")
            try:
                wait_ready(running[system][1], proc)
            except SystemExit as exc:
                log = (work / f"{system}.log").read_text(errors="replace")
                raise SystemExit(f"{system}: {exc}\n{log[-3000:]}") from None
    except BaseException:
        for proc, _ in running.values():
            stop(proc)
        raise
    return running


def run_slice(
    system: str, url: str, first: int, args: argparse.Namespace, work: Path
) -> dict[str, list[float]]:
    count = args.requests_per_slice
    # A client process's first request pays for its own start-up (torch's first operations,
    # the first touch of its buffers): hundreds of ms against either server, so it is run
    # but not counted, and the figures are the servers'.
    warmup = 1 if args.warmup else 0
    metrics, log = run_client(url, args, first, count + warmup, work / f"{system}.json")
    results = metrics["results"]
    if results["checksum_fail"] or results["checksum_ok"] != count + warmup:
        raise SystemExit(
            f"{system}: checksums failed for requests {first}..{first + count + warmup - 1}: {results}"
        )
    found = samples_of(log, first if warmup else None)
    if any(len(values) != count for values in found.values()):
        raise SystemExit(
            f"{system}: the client's log lacks some operations: { {k: len(v) for k, v in found.items()} }"
        )
    return found


#: how long the stall probe sleeps between looks at the clock
PROBE_SLEEP_S = 0.002
#: a wake-up later than this counts as a stall
STALL_MS = 3.0


def stall_probe(output: str) -> None:
    """Sleep ``PROBE_SLEEP_S`` at a time until SIGTERM, then write how late each wake-up
    was (ms, those over 0.5 ms) to ``output``: the scheduling delays any process on this
    machine suffered during the run, whatever the servers do."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    late: list[float] = []
    while not stop:
        began = time.perf_counter()
        time.sleep(PROBE_SLEEP_S)
        delay = (time.perf_counter() - began - PROBE_SLEEP_S) * 1e3
        if delay > 0.5:
            late.append(round(delay, 3))
    Path(output).write_text(json.dumps(late))


def start_stall_probe(work: Path) -> tuple[subprocess.Popen[bytes], Path]:
    output = work / "stalls.json"
    command = [sys.executable, __file__, "--stall-probe", str(output)]
    return subprocess.Popen(command), output


def stop_stall_probe(probe: subprocess.Popen[bytes], output: Path) -> list[float]:
    probe.send_signal(signal.SIGTERM)
    probe.wait(30)
    return list(json.loads(output.read_text())) if output.exists() else []


def cpu_ticks() -> list[int]:
    """The machine's CPU time so far by kind (user, nice, system, idle, iowait, irq, softirq,
    steal, ...), in clock ticks: /proc/stat's first line; empty where there is none."""
    try:
        with open("/proc/stat") as stat:
            return [int(field) for field in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def steal_share(before: list[int], after: list[int]) -> float | None:
    """Share of the machine's CPU time the hypervisor gave to others (steal) between two
    ``cpu_ticks``: a stall the VM causes shows up here, one we cause does not."""
    if len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return (after[7] - before[7]) / total if total > 0 else 0.0


def memcpy_ms(nbytes: int) -> float:
    """Best of several copies of ``nbytes`` between two pre-faulted buffers."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(10):
        began = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - began)
    return best * 1e3


def request_bytes(shape_spec: str, tokens: int) -> int:
    """KV bytes of one request's full chunks for a spec ``(2,NB,BS,NH,HS):dtype:layers``."""
    dims, dtype, layers = shape_spec.rsplit(":", 2)
    planes, _, _, heads, head_size = (int(x) for x in dims.strip("()").split(","))
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}[dtype]
    full = tokens // 256 * 256
    return planes * int(layers) * full * heads * head_size * itemsize


def main() -> None:
    parser = BenchParser(__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=8, help="client runs per server and configuration")
    parser.add_argument("--requests-per-slice", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--shape-spec", default="(2,256,16,8,128):bfloat16:8")
    parser.add_argument(
        "--l1-size-gb", type=int, default=2, help="L1 of both servers (LMCache takes whole GB)"
    )
    parser.add_argument(
        "--tiers-l2", choices=("fs", "nixl"), default="fs", help="lmcache-tiers' file L2 adapter (default fs)"
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="the file L2s with O_DIRECT (LMCache's fs and ours: use_odirect; nixl: use_direct_io)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="count each client process's first request too (its start-up, not the server's)",
    )
    parser.add_argument(
        "--systems",
        choices=("both", "tiers"),
        default="both",
        help="tiers: lmcache-tiers alone (its figures and the limits; no reference columns)",
    )
    parser.add_argument(
        "--configs",
        choices=("both", "l1", "l2"),
        default="both",
        help="l1: L1 only; l2: with the file L2 only (default both)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--stall-probe", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stall_probe:
        stall_probe(args.stall_probe)
        return
    if not (REF_VENV / "bin" / "lmcache").exists():
        raise SystemExit(f"no reference LMCache in {REF_VENV}: run scripts/install_reference_lmcache.sh")

    systems = ["reference", "tiers"] if args.systems == "both" else ["tiers"]
    configs = {"both": (False, True), "l1": (False,), "l2": (True,)}[args.configs]
    work = Path(tempfile.mkdtemp(prefix="bench-lmcache-mp-", dir=os.environ.get("BENCH_DIR")))
    samples: dict[tuple[bool, str], dict[str, list[float]]] = {}
    floors_us: list[float] = []
    probe, probe_output = start_stall_probe(work)
    ticks_before = cpu_ticks()
    stalls: list[float] = []
    try:
        for with_l2 in configs:
            running = start_both(with_l2, args, work, systems)
            try:
                for index in range(args.slices):
                    order = systems if index % 2 == 0 else systems[::-1]
                    first = index * (args.requests_per_slice + (1 if args.warmup else 0))
                    for system in order:
                        print(
                            f"L2 {'on' if with_l2 else 'off'}, slice {index + 1}/{args.slices}: {system}",
                            file=sys.stderr,
                            flush=True,
                        )
                        pooled = samples.setdefault((with_l2, system), {name: [] for name in FIGURES})
                        for name, values in run_slice(system, running[system][1], first, args, work).items():
                            pooled[name].extend(values)
                floors_us.append(measure_floor("tcp", run_bench_keys(4))[1])
            finally:
                for proc, _ in running.values():
                    stop(proc)
    finally:
        stalls = stop_stall_probe(probe, probe_output)
        steal = steal_share(ticks_before, cpu_ticks())
        shutil.rmtree(work, ignore_errors=True)

    copy_ms = memcpy_ms(request_bytes(args.shape_spec, args.tokens))
    round_trip_ms = 2 * statistics.median(floors_us) / 1e3
    limits = {
        "store": copy_ms,
        "retrieve": copy_ms,
        "lookup (miss)": round_trip_ms,
        "lookup (hit)": round_trip_ms,
    }
    table = []
    for with_l2 in configs:
        for name in FIGURES:
            row: dict[str, Any] = {"l2": with_l2, "figure": name, "limit_ms": round(limits[name], 3)}
            for system in systems:
                values = samples[(with_l2, system)][name]
                row[f"{system}_p50_ms"] = statistics.median(values)
                row[f"{system}_p90_ms"] = percentile(values, 0.9)
                row[f"{system}_p99_ms"] = percentile(values, 0.99)
                row[f"{system}_samples_ms"] = values  # request order: where the slow ones fall
                row["samples"] = len(values)
            if "reference" in systems:
                row["faster"] = (
                    row["tiers_p50_ms"] < row["reference_p50_ms"]
                    and row["tiers_p99_ms"] < row["reference_p99_ms"]
                )
            table.append(row)
    summary: dict[str, Any] = {
        "requests": args.slices * args.requests_per_slice,
        "tokens": args.tokens,
        "shape_spec": args.shape_spec,
        "request_mib": request_bytes(args.shape_spec, args.tokens) / 2**20,
        "slices": args.slices,
        "warmup_requests_per_slice": 1 if args.warmup else 0,
        "rows": table,
        # a process that only sleeps, next to the servers: how late the machine woke it
        "idle_process_longest_wakeup_delay_ms": max(stalls, default=0.0),
        "idle_process_stalls_over_3ms": sum(1 for delay in stalls if delay > STALL_MS),
        # the hypervisor's share of the run (/proc/stat steal): stalls the VM causes
        "steal_share": steal,
    }
    if "reference" in systems:
        summary["faster_on_every_figure"] = all(row["faster"] for row in table)
    lookup_p99 = None
    if True in configs:
        lookup_p99 = max(
            row["tiers_p99_ms"] for row in table if row["l2"] and row["figure"].startswith("lookup")
        )
        summary["tiers_lookup_p99_with_l2_ms"] = lookup_p99
        summary["lookup_p99_target_met"] = lookup_p99 < LOOKUP_P99_TARGET_MS
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"LMCache bench server --mode cpu: {summary['requests']} requests x {args.tokens} tokens, "
        f"{summary['request_mib']:.0f} MiB each, {args.shape_spec}; {args.slices} alternating slices, "
        f"{table[0]['samples']} samples per figure (ms)"
    )
    reference_column = f"{'reference p50/p99':>20}" if "reference" in systems else ""
    faster_column = "  faster" if "reference" in systems else ""
    header = f"{'L2':<5}{'figure':<15}{reference_column}{'lmcache-tiers p50/p99':>24}{'limit':>9}"
    print(header + faster_column)
    for row in table:
        ref = ""
        if "reference" in systems:
            ref = f"{row['reference_p50_ms']:.2f} / {row['reference_p99_ms']:.2f}"
            ref = f"{ref:>20}"
        tiers = f"{row['tiers_p50_ms']:.2f} / {row['tiers_p99_ms']:.2f}"
        faster = f"  {'yes' if row['faster'] else 'NO'}" if "reference" in systems else ""
        where = "file" if row["l2"] else "none"
        print(f"{where:<5}{row['figure']:<15}{ref}{tiers:>24}{row['limit_ms']:>9.2f}{faster}")
    print(
        f"limits: memcpy of one request's KV bytes {copy_ms:.2f} ms; two bare ZeroMQ round trips "
        f"{round_trip_ms:.3f} ms"
    )
    print(
        f"scheduling during the run: a process that only sleeps woke up to "
        f"{summary['idle_process_longest_wakeup_delay_ms']:.1f} ms late "
        f"({summary['idle_process_stalls_over_3ms']} wake-ups over {STALL_MS:g} ms late); "
        "a request caught in such a stall waits as long"
    )
    if steal is not None:
        print(
            f"steal time during the run (CPU the hypervisor gave to other guests): {steal:.2%}"
            " -- a stall the VM causes shows here, one this machine's own work causes does not"
        )
    if lookup_p99 is not None:
        verdict = "met" if summary["lookup_p99_target_met"] else "NOT met"
        print(
            f"lmcache-tiers lookup p99 with the L2: {lookup_p99:.2f} ms "
            f"(target < {LOOKUP_P99_TARGET_MS:g} ms: {verdict})"
        )
    if "reference" in systems:
        print(f"faster on every figure: {'yes' if summary['faster_on_every_figure'] else 'no'}")


if __name__ == "__main__":
    main()
