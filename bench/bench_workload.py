"""The reference's workload shape through our client: per-operation p50/p99 next to memcpy.

Requests of ``--tokens`` tokens in chunks of ``--chunk-tokens`` (one object each,
``--bytes-per-token`` KV bytes per token with the bfloat16 layout
``[2, layers, chunk_tokens, heads, head_dim]``), by default LMCache's ``lmcache bench
server --mode cpu`` sizes: 8 requests of 512 tokens, 32 MiB each in 4 chunks of 8 MiB.
Each request is stored, looked up and retrieved (into pre-faulted buffers, wiped before
and compared with the stored bytes after, both untimed), one after the other,
``--rounds`` times with new keys; the p50/p99 of each operation are over every request
(``--requests`` x ``--rounds`` samples: 96 by default, whose p99 is the second slowest),
next to a memcpy of one request's bytes between pre-faulted buffers measured in the same
run (and, as "cold memcpy", the same copy into targets out of cache, as a store's copy
into an extent of the arena is: the memcpy figure reuses one set of targets, which stay
cached).  Scenarios (``--scenarios``):

* ``warm``   -- one client for every request, L1 only;
* ``fresh``  -- a new client per request (connect, store, lookup, retrieve, close), L1
                only: the first copies of a client that just connected;
* ``l2``     -- one client, with an L2 adapter (``--l2``: ``nixl`` = nixl_store_dynamic on
                NIXL's POSIX backend, ``fs``; ``--direct``: with O_DIRECT writes) so every
                store is written back while the next requests run: what write-back costs
                the data plane;
* ``l2-fresh`` -- both.

Next to each scenario's lookups, its floor: a bare ZeroMQ round trip of the same request
bytes to an echo process (its reply waited for as the client waits for its own), timed
once per request in the same loop and placed as a lookup is (after a copy of the request's
bytes and a round trip that woke the other side), while the same server and its write-back
run, the echo process at the priority the server gives its request threads.  Its p99 over
its p50 is the tail the machine itself gives a round trip there, which a lookup's cannot
beat.

Where the arena lives decides what a fresh client's first copies cost: on /dev/shm without
huge pages every 4 KiB page of its mapping takes a fault, on a tmpfs mounted ``huge=always``
every 2 MiB does.  ``--shm-dir DIR`` runs every scenario with the arena in DIR;
``--huge-tmpfs`` (root) mounts a huge-page tmpfs for the run, runs every scenario twice,
on /dev/shm and on it, and removes it after.  Each row says which pages the server got
(its own /status), next to the memcpy measured in the same run.

L1 keeps every round's objects until the next round starts, then they are evicted (EVICT:
L2 copies stay, objects not yet in L2 stay too), so L1 never fills: with an L2 it has room
for every round, since write-back may lag behind back-to-back requests.  The reference
server's own numbers on the same sizes come from ``bench/bench_lmcache_mp.py`` (its client
against both servers), which ``bench/run_all.py`` runs next to this one when the reference
venv exists.

    python bench/bench_workload.py                        # every scenario, nixl L2
    python bench/bench_workload.py --scenarios fresh --rounds 5 --json
    python bench/bench_workload.py --scenarios fresh,warm --huge-tmpfs   # 4 KiB vs 2 MiB pages
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import BenchParser
from bench_server import echo_process, echo_round_trips, echo_socket, floor_request, start_server
from server_store import l2_adapter_json, wait_populated

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.priority import REQUEST_NICE
from lmcache_tiers.testing.mounts import tmpfs_at

SCENARIOS = ("warm", "fresh", "l2", "l2-fresh")
OPERATIONS = ("connect", "store", "lookup", "retrieve")
#: the lookup's floor: a bare ZeroMQ round trip of the lookup's bytes to an echo process,
#: timed in the same loop (``EchoFloor``)
ECHO = "echo"


@dataclass
class Shape:
    requests: int = 8
    tokens: int = 512
    chunk_tokens: int = 128
    bytes_per_token: int = 65536  # 2 (K, V) x 16 layers x 8 heads x 128 x 2 bytes

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.chunk_tokens)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.bytes_per_token

    @property
    def request_bytes(self) -> int:
        return self.chunks * self.chunk_bytes

    @property
    def layout(self) -> str:
        per_head_layer = self.bytes_per_token // (2 * 2)  # K and V, 2-byte elements
        layers, heads = 16, max(1, per_head_layer // (16 * 128))
        if 16 * heads * 128 != per_head_layer:
            return ""  # not a whole number of 128-wide heads over 16 layers: plain bytes
        return f"bfloat16[2,{layers},{self.chunk_tokens},{heads},128]"


@dataclass
class ScenarioResult:
    scenario: str
    l2: str
    requests: int
    request_bytes: int
    memcpy_ms: float
    #: the same copy into destinations out of cache (a store's extent is one)
    memcpy_cold_ms: float = 0.0
    #: the arena's directory and whether the server reports it on huge pages
    shm_dir: str = "/dev/shm"
    huge_pages: bool = False
    p50_ms: dict[str, float] = field(default_factory=dict)
    p99_ms: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    #: ``echo`` (the lookup's floor), p50 and p99 in ms, taken as ``EchoFloor.measure`` says
    echo_p50_ms: float = 0.0
    echo_p99_ms: float = 0.0

    def ratio(self, operation: str) -> float:
        """memcpy time over the operation's p50: 1.0 is memcpy speed."""
        p50 = self.p50_ms.get(operation, 0.0)
        return self.memcpy_ms / p50 if p50 else 0.0


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]


def memcpy_ms(sources: list[np.ndarray[Any, Any]], repeats: int = 9, spread: int = 1) -> float:
    """One thread copying ``sources`` between pre-faulted buffers: into the same targets
    every time (``spread`` 1, the limit quoted), or into ``spread`` sets of them in turn,
    so that with a large ``spread`` every copy lands in memory not in any cache, as a
    store's copy into an extent of the arena does."""
    targets = [[np.ones_like(source) for source in sources] for _ in range(spread)]  # pre-faulted
    times = []
    for repeat in range(max(repeats, spread + repeats // 2)):
        start = time.perf_counter()
        for source, target in zip(sources, targets[repeat % spread], strict=True):
            np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


#: sets of targets ``memcpy_ms`` copies into for the cold-destination figure: 8 x 32 MiB
#: is past what the caches hold here
COLD_SPREAD = 8


def at_request_priority(pid: int) -> None:
    """Every thread of process ``pid`` (the echo process: its loop and ZeroMQ's I/O thread)
    at the nice the server runs its request threads at, so that the floor's round trip
    competes for a core as the server's requests do; said on stderr where the OS refuses."""
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(task), REQUEST_NICE)
    except OSError as exc:
        print(f"the echo process keeps its priority: nice {REQUEST_NICE} refused ({exc})", file=sys.stderr)


class EchoFloor:
    """Bare round trips to an echo process (``sock``), one per request, in ms."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.samples: list[float] = []

    def measure(
        self, request: bytes, sources: list[np.ndarray[Any, Any]], targets: list[np.ndarray[Any, Any]]
    ) -> None:
        """Time one round trip of ``request`` (a LOOKUP's bytes) placed as a lookup is: a
        lookup follows its store, a copy of the request's bytes and a round trip that woke
        the server, so this follows a copy of the same bytes and an untimed round trip that
        woke the echo process.  Taken in the same loop, while the same server (and its
        write-back) runs, the samples' p99 over their p50 is what the machine itself gives
        a round trip there: the floor of the lookup's."""
        for source, target in zip(sources, targets, strict=True):
            np.copyto(target, source)
        _, waking_then_timed = echo_round_trips(self.sock, request, 2)
        self.samples.append(waking_then_timed[1] / 1e3)


def run_scenario(
    scenario: str,
    shape: Shape,
    rounds: int,
    l2: str,
    transport: str,
    direct: bool = False,
    shm_dir: str | None = None,
    timeline: list[dict[str, Any]] | None = None,
) -> ScenarioResult:
    """``scenario``'s figures, with the lookup's floor (``EchoFloor``) taken from an echo
    process started next to its server."""
    with contextlib.ExitStack() as stack:
        echo_url, echo_pid = stack.enter_context(echo_process(transport))
        at_request_priority(echo_pid)
        sock = echo_socket(echo_url)
        stack.callback(sock.close, 0)
        floor = EchoFloor(sock)
        result = _run_scenario(scenario, shape, rounds, l2, transport, direct, shm_dir, timeline, floor)
    result.echo_p50_ms = statistics.median(floor.samples)
    result.echo_p99_ms = percentile(floor.samples, 0.99)
    return result


def _run_scenario(
    scenario: str,
    shape: Shape,
    rounds: int,
    l2: str,
    transport: str,
    direct: bool,
    shm_dir: str | None,
    timeline: list[dict[str, Any]] | None,
    floor: EchoFloor,
) -> ScenarioResult:
    with_l2 = scenario.startswith("l2")
    fresh = scenario.endswith("fresh")
    rng = np.random.default_rng(7)
    sources = [rng.integers(0, 256, shape.chunk_bytes, dtype=np.uint8) for _ in range(shape.chunks)]
    targets = [np.ones(shape.chunk_bytes, dtype=np.uint8) for _ in range(shape.chunks)]
    layouts = [shape.layout] * shape.chunks
    round_bytes = shape.requests * shape.request_bytes
    l2_root = tempfile.mkdtemp(prefix="lmcache-tiers-bench-l2-") if with_l2 else ""
    capacity_gb = 4 * rounds * round_bytes / 2**30 + 1
    adapters = [l2_adapter_json(l2, l2_root, capacity_gb, direct=direct)] if with_l2 else []
    # Objects not yet in L2 are never evicted: with L2, room for every round
    l1_rounds = rounds + 1 if with_l2 else 3
    l1_gb = l1_size_gb(l1_rounds * round_bytes, shm_dir)
    keeper: Client | None = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, url = start_server(l1_gb, transport, adapters, ["--shm-dir", shm_dir] if shm_dir else [])
        result = ScenarioResult(
            scenario,
            (l2 + (" O_DIRECT" if direct else "")) if with_l2 else "",
            shape.requests * rounds,
            shape.request_bytes,
            memcpy_ms(sources),
            memcpy_ms(sources, spread=COLD_SPREAD),
        )
        samples: dict[str, list[float]] = {name: [] for name in OPERATIONS}
        salt = f"workload-{os.getpid()}-{scenario}"
        keeper = Client(url, timeout=60, name="bench-workload")
        pages = keeper.status()["server"].get("l1_pages") or {}
        result.shm_dir, result.huge_pages = pages.get("directory", "/dev/shm"), bool(pages.get("huge_pages"))
        if not fresh:
            # Rounds with an L2 take fresh L1 extents (the earlier ones wait for write-back),
            # the others reuse evicted ones: without this, l2 vs warm would compare first
            # touches of the segment, not write-back.
            wait_populated(keeper)
        for round_index in range(rounds):
            stored: list[ObjectKey] = []
            for request in range(shape.requests):
                keys = [
                    ObjectKey("bench-workload", 0, f"{round_index}-{request}-{chunk}".encode(), 0, salt)
                    for chunk in range(shape.chunks)
                ]
                # Wiped (untimed) so that the byte check below is of this retrieve: every
                # request stores the same bytes, and the floor copies them into these buffers.
                for target in targets:
                    target.fill(0)
                began = time.perf_counter()
                client = Client(url, timeout=60, name="bench-fresh") if fresh else keeper
                connected = time.perf_counter()
                try:
                    if client.store(keys, sources, layouts) != len(keys):
                        raise SystemExit(f"{scenario}: a request was not stored in full (L1 too small?)")
                    stored_at = time.perf_counter()
                    if client.lookup(keys) != len(keys):
                        raise SystemExit(f"{scenario}: a stored request was not found")
                    looked_up = time.perf_counter()
                    if client.retrieve_into(keys, targets) != len(keys):
                        raise SystemExit(f"{scenario}: a stored request was not retrieved in full")
                    retrieved = time.perf_counter()
                finally:
                    if fresh:
                        client.close()
                if timeline is not None:
                    # CLOCK_MONOTONIC, as `perf record -k CLOCK_MONOTONIC` stamps its events
                    marks = (began, connected, stored_at, looked_up, retrieved)
                    spans = zip(OPERATIONS, marks, marks[1:], strict=False)
                    timeline.append(
                        {"scenario": scenario, "server_pid": proc.pid, "request": f"{round_index}-{request}"}
                        | {name: (end, (end - start) * 1e3) for name, start, end in spans}
                    )
                if fresh:
                    samples["connect"].append((connected - began) * 1e3)
                samples["store"].append((stored_at - connected) * 1e3)
                samples["lookup"].append((looked_up - stored_at) * 1e3)
                samples["retrieve"].append((retrieved - looked_up) * 1e3)
                if any(not np.array_equal(s, t) for s, t in zip(sources, targets, strict=True)):
                    raise SystemExit(f"{scenario}: retrieved bytes differ from the stored ones")
                floor.measure(floor_request(keys), sources, targets)
                stored.extend(keys)
            keeper.evict(stored)  # L1 room for the next round; L2 copies stay
    finally:
        if keeper is not None:
            keeper.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        if l2_root:
            shutil.rmtree(l2_root, ignore_errors=True)
    for name, values in samples.items():
        if values:
            result.samples[name] = values
            result.p50_ms[name] = statistics.median(values)
            result.p99_ms[name] = percentile(values, 0.99)
    return result


def l1_size_gb(need: int, shm_dir: str | None) -> float:
    """The L1 for ``need`` bytes: at least 1 GiB, but within a smaller tmpfs (--shm-dir)."""
    wanted = max(1.0, need / 2**30)
    if shm_dir is None:
        return wanted
    info = os.statvfs(shm_dir)
    room = (info.f_bavail * info.f_frsize - (64 << 20)) / 2**30  # the generation table, rounding
    return max(need / 2**30, min(wanted, room))


@contextlib.contextmanager
def huge_tmpfs(size_gb: float) -> Iterator[str]:
    """A tmpfs mounted huge=always for the run (needs root), removed after."""
    directory = tempfile.mkdtemp(prefix="lmcache-tiers-bench-huge-")
    with tmpfs_at(directory, f"size={int(size_gb * 1024)}m,huge=always") as refused:
        if refused is not None:
            raise SystemExit(f"--huge-tmpfs: {refused}")
        yield directory


def run(
    scenarios: list[str],
    shape: Shape,
    rounds: int = 3,
    l2: str = "nixl",
    transport: str = "tcp",
    direct: bool = False,
    shm_dirs: tuple[str | None, ...] = (None,),
    timeline: list[dict[str, Any]] | None = None,
) -> list[ScenarioResult]:
    """Every scenario in turn (each with a server of its own), once per arena directory
    (None: the default, /dev/shm); the figures, for run_all.  ``timeline`` (when given)
    gets one entry per request: each operation's end on the monotonic clock and its
    duration, to line slow requests up with a trace."""
    return [
        run_scenario(name, shape, rounds, l2, transport, direct, shm_dir, timeline)
        for name in scenarios
        for shm_dir in shm_dirs
    ]


def print_table(results: list[ScenarioResult]) -> None:
    print(
        f"{'scenario':<10} {'pages':<6} {'operation':<9} {'p50 ms':>8} {'p99 ms':>8} {'p99/p50':>8} "
        f"{'memcpy ms':>10} {'memcpy/p50':>10} {'cold memcpy':>11}"
    )
    for result in results:
        for name in OPERATIONS:
            if name not in result.p50_ms:
                continue
            p50, p99 = result.p50_ms[name], result.p99_ms[name]
            copy = (
                f"{result.memcpy_ms:10.2f} {result.ratio(name):10.2f} {result.memcpy_cold_ms:11.2f}"
                if name in ("store", "retrieve")
                else ""
            )
            label = result.scenario + (f" ({result.l2})" if result.l2 else "")
            pages = "2M" if result.huge_pages else "4K"
            print(f"{label:<10} {pages:<6} {name:<9} {p50:8.2f} {p99:8.2f} {p99 / p50:8.2f} {copy}")
            if name == "lookup" and result.echo_p50_ms:
                # the lookup's floor, in the same loop: what the machine gives a round trip
                p50, p99 = result.echo_p50_ms, result.echo_p99_ms
                print(f"{label:<10} {pages:<6} {ECHO:<9} {p50:8.2f} {p99:8.2f} {p99 / p50:8.2f}")


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated of {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--bytes-per-token", type=int, default=65536)
    parser.add_argument(
        "--rounds",
        type=int,
        default=12,
        help="passes over the requests, new keys each (12 x 8 requests: a p99 of ~100 samples)",
    )
    parser.add_argument("--l2", default="nixl", choices=("nixl", "fs"))
    parser.add_argument("--transport", default="tcp", choices=("tcp", "ipc"))
    parser.add_argument(
        "--direct", action="store_true", help="the L2 writes with O_DIRECT (use_direct_io / use_odirect)"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--shm-dir", help="put the arena in this tmpfs directory (serve --shm-dir)")
    where.add_argument(
        "--huge-tmpfs",
        action="store_true",
        help="mount a huge=always tmpfs for the run (root) and run each scenario on /dev/shm and on it",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--timeline",
        metavar="FILE",
        help="write each request's operation end times (CLOCK_MONOTONIC) and durations as JSON lines",
    )
    args = parser.parse_args()
    scenarios = [name for name in args.scenarios.split(",") if name]
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    shape = Shape(args.requests, args.tokens, args.chunk_tokens, args.bytes_per_token)
    timeline: list[dict[str, Any]] | None = [] if args.timeline else None
    with contextlib.ExitStack() as stack:
        shm_dirs: tuple[str | None, ...] = (args.shm_dir,)
        if args.huge_tmpfs:
            # room for the largest L1 a scenario asks for (L2 runs keep every round)
            need = (args.rounds + 1) * shape.requests * shape.request_bytes / 2**30
            shm_dirs = (None, stack.enter_context(huge_tmpfs(max(1.0, need) + 0.25)))
        results = run(scenarios, shape, args.rounds, args.l2, args.transport, args.direct, shm_dirs, timeline)
    if args.timeline and timeline is not None:
        with open(args.timeline, "w") as out:
            out.writelines(json.dumps(entry) + "\n" for entry in timeline)
    if args.json:
        print(json.dumps([asdict(result) for result in results], indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
