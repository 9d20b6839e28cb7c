"""Server throughput and latency, each next to its target or limit measured in the same run.

Starts ``lmcache-tiers serve`` in its own process (L1 only, loopback, a free port) unless
``--url`` names a running server, then runs the ``lmcache-tiers bench`` measurements from
this process: STORE and RETRIEVE of N x S bytes through shared memory and inline, each as
GB/s and as a ratio of a plain memcpy of the same bytes; LOOKUP p50/p99 and requests/s.

LOOKUP is also put next to the floor of its transport: a bare ZeroMQ DEALER/ROUTER round
trip (a Python echo process answering each request of the very bytes the client sends for
that LOOKUP with a reply of a LOOKUP reply's size), measured in this run right before and
right after the server's figures, and in rounds that alternate with rounds of the
client's LOOKUPs (the ratio of each pair of rounds, whose median is the figure the
target is judged on: both sides see the same load on the machine); and
PING and LOOKUP are sent to the server through a bare DEALER socket too, next to the echo
process answering the same bytes, placed as those rounds are, which splits a round trip
into the transport's, the server's and the client library's shares.  Every bare round
trip waits for its reply as the client does (polled for up to the client's default
``reply_spin_s``, then slept on), so the floor saves the same wake-up the client does.  How
fast a sequential round trip can be depends on where the scheduler puts the two processes
(sharing a core, or each on its own), so the floor moves with the machine and the load on
it; the ratio to it does not.  What each key adds to a LOOKUP is the gap between a long
and a short one, measured for the same key list every time, a different list each time,
the RELEASE of what it locked, and keys nobody stored or named before (all misses, each
checked for the first time; a LOOKUP decodes only the first).

    python bench/bench_server.py                       # 64 x 2 MiB, 16-key lookups, tcp://
    python bench/bench_server.py --transport ipc       # the same over ipc://
    python bench/bench_server.py --chunks 128 --chunk-mib 1 --json
    python bench/bench_server.py --l2 nixl              # + STORE while L2 write-back runs
    python bench/bench_server.py --clients 4            # + STORE from 4 processes at once

``--l2`` starts the server with a file L2 adapter (``--direct``: O_DIRECT writes) and adds
STORE under write-back, ``--clients`` adds STORE from several processes at once, each next
to its limit (``bench/server_store.py`` says how they are measured).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import BenchParser
from server_store import StoreFigures, l2_adapter_json, store_many_clients, store_under_write_back

from lmcache_tiers.cli.commands_server import bench_table, run_with_progress
from lmcache_tiers.cli.output import stdout
from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.client.spin import REPLY_SPIN_S, poll_for_reply
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.benchmark import BenchKeys
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.wire import protocol as p

STORE_TARGET = 0.5  # of memcpy
LOOKUP_TARGET_PER_S = 10_000
LOOKUP_FLOOR_TARGET = 0.8  # of the bare round trip, 16-key LOOKUP (issue 16)
PER_KEY_TARGET_US = 0.3  # extra cost per key of a long LOOKUP over a short one (issue 16)
ECHO_REQUESTS = 20_000
#: how long a floor's round trip polls for its reply before sleeping on it: as the client
REPLY_SPIN_NS = int(REPLY_SPIN_S * 1e9)
#: pairs of rounds (echo, LOOKUP) of ``lookup_against_floor``: short rounds, so that a
#: burst of load on the shared machine falls on both rounds of a pair or on few pairs
FLOOR_ROUNDS = 40
#: the ``wait_s`` a client puts in its LOOKUP (a server with ``lookup_wait``): in the echo
#: request too, so that it is as long as the request it stands for
CLIENT_LOOKUP_WAIT_S = 10.0


def endpoint(transport: str, name: str) -> tuple[str, str]:
    """(``--host`` value or "127.0.0.1", ZeroMQ URL) for a new endpoint of ``transport``."""
    if transport == "ipc":
        url = f"ipc://{tempfile.gettempdir()}/lmcache-tiers-bench-{name}-{os.getpid()}.sock"
        return url, url
    return "127.0.0.1", f"tcp://127.0.0.1:{free_port()}"


def start_server(
    l1_size_gb: float, transport: str, l2_adapters: Sequence[str] = (), extra_args: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``lmcache-tiers serve`` (L1 only unless ``l2_adapters`` gives --l2-adapter JSON;
    ``extra_args``: more ``serve`` flags)."""
    host, url = endpoint(transport, "server")
    port = url.rsplit(":", 1)[1] if transport == "tcp" else "0"
    l2 = [arg for adapter in l2_adapters for arg in ("--l2-adapter", adapter)] or ["--no-default-l2"]
    command = [
        sys.executable, "-m", "lmcache_tiers.cli.main", "serve",
        "--l1-size-gb", str(l1_size_gb), *l2, "--host", host, "--port", port,
        "--metrics-port", "0", *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} during start-up")
        try:
            with Client(url, timeout=0.5) as client:
                client.ping()
            return proc, url
        except ClientError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the server did not start within 60 s") from None


# -- the transport's floor -------------------------------------------------------------------

# What a LOOKUP gets back, as long: request ids in the tens of thousands, a handle of the
# server's 62-bit random base plus a count.
_ECHO_REPLY = p.encode(p.LookupReply(1 << 20, handle=(1 << 62) + 1, hits=16))
_STOP = b"stop"


def floor_request(keys: Sequence[ObjectKey]) -> bytes:
    """The bytes the client sends for a LOOKUP of ``keys`` (a request id in the tens of
    thousands, the wait it adds), for the echo process: the floor's request is as long as
    the request it is the floor of."""
    return p.encode(p.Lookup(1 << 20, "", list(keys), CLIENT_LOOKUP_WAIT_S))


def run_bench_keys(count: int) -> list[ObjectKey]:
    """Keys shaped as ``run_bench``'s LOOKUP keys (its model, tag and salt lengths)."""
    return BenchKeys().make("lookup", count)


def slope_keys(count: int) -> list[ObjectKey]:
    """The keys of ``lookup_p50s`` (and of the echo round trip its slope is put next to)."""
    salt = f"bench-slope-{os.getpid()}"
    return [ObjectKey("bench-slope", 0, index.to_bytes(4, "big") * 8, 0, salt) for index in range(count)]


def echo_server(url: str) -> None:
    """Answer every request at once: a ROUTER loop with nothing else in it."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(url)
    print("ready", flush=True)
    more = int(zmq.SNDMORE)
    while True:
        identity = sock.recv()
        request = sock.recv()
        if request == _STOP:
            break
        sock.send(identity, more)
        sock.send(_ECHO_REPLY)
    sock.close(0)


def echo_socket(url: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(url)
    return sock


def receive_reply(sock: zmq.Socket[bytes]) -> None:
    """Wait for the next reply as the client waits for its own: polled for up to its
    default ``reply_spin_s``, then slept on (client/spin.py), so that a floor and the
    client's calls it is put next to save the same wake-up."""
    if poll_for_reply(sock, REPLY_SPIN_NS) is None:
        sock.recv()


def echo_round_trips(sock: zmq.Socket[bytes], request: bytes, requests: int) -> tuple[float, list[float]]:
    """``requests`` sequential round trips of ``request``: (seconds, each in microseconds)."""
    samples: list[float] = []
    began = time.perf_counter()
    for _ in range(requests):
        start = time.perf_counter_ns()
        sock.send(request)
        receive_reply(sock)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return time.perf_counter() - began, samples


def echo_floor(url: str, keys: Sequence[ObjectKey], requests: int) -> tuple[float, float]:
    """Sequential round trips of the request a LOOKUP of ``keys`` sends, to the echo
    process: (requests/s, p50 in microseconds)."""
    request = floor_request(keys)
    sock = echo_socket(url)
    try:
        echo_round_trips(sock, request, 500)
        elapsed, samples = echo_round_trips(sock, request, requests)
    finally:
        sock.close(0)
    return requests / elapsed, statistics.median(samples)


@contextlib.contextmanager
def echo_process(transport: str) -> Iterator[tuple[str, int]]:
    """An echo process on a fresh endpoint of ``transport``, stopped on the way out: its
    URL and pid."""
    _, url = endpoint(transport, "echo")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--echo-server", url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("the echo process did not start")
        yield url, proc.pid
        stopper: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        stopper.setsockopt(zmq.LINGER, 1000)
        stopper.connect(url)
        stopper.send(_STOP)
        stopper.close()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if url.startswith("ipc://"):
            # libzmq leaves the socket file behind when the echo process unbinds.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(url[len("ipc://") :])


def measure_floor(transport: str, keys: Sequence[ObjectKey]) -> tuple[float, float]:
    """Start an echo process on a fresh endpoint of ``transport`` and measure it with the
    request a LOOKUP of ``keys`` sends."""
    with echo_process(transport) as (url, _):
        return echo_floor(url, keys, ECHO_REQUESTS)


@contextlib.contextmanager
def pinned(placements: dict[int, int]) -> Iterator[None]:
    """Every thread of each process (pid) on the one CPU given for it, and on the way out
    where it was, or for a thread started meanwhile (pinned, as its starter was), where
    its process's main thread was."""
    saved: dict[int, dict[int, set[int]]] = {}
    try:
        for pid, cpu in placements.items():
            threads = saved.setdefault(pid, {})
            for tid in _threads_of(pid):
                with contextlib.suppress(ProcessLookupError):
                    threads[tid] = os.sched_getaffinity(tid)
                    os.sched_setaffinity(tid, {cpu})
        yield
    finally:
        for pid, threads in saved.items():
            default = threads.get(pid)
            for tid in _threads_of(pid):
                cpus = threads.get(tid, default)
                if cpus is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.sched_setaffinity(tid, cpus)


def _threads_of(pid: int) -> list[int]:
    try:
        return [int(task) for task in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:  # the process ended
        return []


def floor_placement(server_pid: int | None) -> tuple[int, int] | None:
    """(this process's CPU, the server's and the echo process's CPU) for
    ``lookup_against_floor``, or None: no server process of this run, or one CPU."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if server_pid is None or len(cpus) < 2:
        return None
    return cpus[0], cpus[1]


def lookup_against_floor(
    url: str, transport: str, lookup_keys: int, requests: int, server_pid: int | None = None
) -> tuple[float, float, float, tuple[int, int] | None]:
    """Sequential LOOKUPs of ``lookup_keys`` keys in L1 through the client, and the bare
    round trip of the same request bytes to an echo process, in alternating rounds (each
    ``requests`` / ``FLOOR_ROUNDS`` long, the order turned every pair): (median over the
    pairs of LOOKUP/s over echo/s, median LOOKUP/s, median echo/s, the placement).  The before/after floor
    next to one long LOOKUP run compares figures taken under different loads on a shared
    machine; a pair of rounds is taken under the same one.  Each round's locks are
    released after it, as an engine done with the prompt does.

    With the pid of the server process (started by this run) and two CPUs or more
    (``floor_placement``), this process is pinned to one CPU for the rounds, the server
    and the echo process to another.  A sequential round trip is about twice as
    fast with the two ends on cores of their own as on one shared core, and the scheduler
    picks either for each process pair: unpinned, the two sides of a pair may be measured
    under different placements and the ratio swings (0.24x-0.83x in three runs of one
    minute).  Pinned, both are measured as an engine and a server on a larger machine
    run, each on its own core."""
    keys = run_bench_keys(lookup_keys)
    per_round = max(1, requests // FLOOR_ROUNDS)
    request = floor_request(keys)
    lookup_rates: list[float] = []
    echo_rates: list[float] = []
    placement = floor_placement(server_pid)
    with echo_process(transport) as (echo_url, echo_pid), Client(url) as client:
        client.store(keys, [bytes(4096)] * lookup_keys, l1_only=True)
        sock = echo_socket(echo_url)
        placements = {}
        if placement is not None and server_pid is not None:
            placements = {os.getpid(): placement[0], server_pid: placement[1], echo_pid: placement[1]}
        try:

            def lookups() -> float:
                began = time.perf_counter()
                for _ in range(per_round):
                    if client.lookup(keys) != lookup_keys:
                        raise SystemExit(f"LOOKUP did not find all {lookup_keys} keys stored in L1")
                elapsed = time.perf_counter() - began
                client.release(keys)
                return per_round / elapsed

            def echoes() -> float:
                return per_round / echo_round_trips(sock, request, per_round)[0]

            with pinned(placements):
                echoes(), lookups()  # warm both up
                for pair in range(FLOOR_ROUNDS):
                    if pair % 2:
                        lookup_rates.append(lookups())
                        echo_rates.append(echoes())
                    else:
                        echo_rates.append(echoes())
                        lookup_rates.append(lookups())
        finally:
            sock.close(0)
            client.evict(keys)
    ratios = [lookup / echo for lookup, echo in zip(lookup_rates, echo_rates, strict=True)]
    return (
        statistics.median(ratios),
        statistics.median(lookup_rates),
        statistics.median(echo_rates),
        placement,
    )


def bare_requests(
    url: str, transport: str, lookup_keys: int, requests: int, server_pid: int | None = None
) -> tuple[float, float, float, float]:
    """p50 in microseconds of a PING and of a ``lookup_keys``-key LOOKUP (keys in L1) sent
    through a bare DEALER socket to the server, then of the same request bytes to an echo
    process, in alternating rounds: the server's share of a round trip, without the
    client library's, next to the transport's.  Placed as ``lookup_against_floor`` places
    its rounds (this process on one CPU, the server and the echo process on another):
    figures of one placement only compare with figures of the same placement, which can
    be twice as fast as another."""
    salt = f"bench-bare-{os.getpid()}"
    keys = [ObjectKey("bench-bare", 0, index.to_bytes(4, "big") * 8, 0, salt) for index in range(lookup_keys)]
    ping, lookup = p.encode(p.Ping(1, "")), p.encode(p.Lookup(2, "", keys))
    served: dict[bytes, list[float]] = {ping: [], lookup: []}
    echoed: dict[bytes, list[float]] = {ping: [], lookup: []}
    placement = floor_placement(server_pid)
    with echo_process(transport) as (echo_url, echo_pid), Client(url) as client:
        client.store(keys, [bytes(4096)] * lookup_keys, l1_only=True)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(url)
        echo = echo_socket(echo_url)
        placements = {}
        if placement is not None and server_pid is not None:
            placements = {os.getpid(): placement[0], server_pid: placement[1], echo_pid: placement[1]}
        try:
            rounds = 10
            per_round = max(1, requests // (2 * rounds))
            with pinned(placements):
                for number in range(rounds):
                    for request in (ping, lookup):
                        sides = ((sock, served), (echo, echoed))
                        for socket, samples in sides if number % 2 else sides[::-1]:
                            samples[request].extend(echo_round_trips(socket, request, per_round)[1])
                    sock.send(lookup)
                    check_bare_lookup(sock.recv(), lookup_keys)
                    sock.send(p.encode(p.Release(3, "", keys)))  # this socket's lookups locked them
                    sock.recv()
        finally:
            sock.close(0)
            echo.close(0)
            client.evict(keys)
    return (
        statistics.median(served[ping]),
        statistics.median(served[lookup]),
        statistics.median(echoed[ping]),
        statistics.median(echoed[lookup]),
    )


def check_bare_lookup(reply: bytes, count: int) -> None:
    """Stop the run unless ``reply`` is a LOOKUP reply finding all ``count`` keys: the bare
    rounds do not decode their replies, and an error reply (a request the server refuses)
    comes back faster than a lookup, so one such request, untimed, follows every round."""
    decoded = p.reply_decoder.decode(reply)
    if (
        not isinstance(decoded, p.LookupReply)
        or decoded.code != p.ErrorCode.OK.value
        or decoded.hits != count
    ):
        raise SystemExit(f"a bare LOOKUP of {count} keys stored in L1 was answered {decoded!r}")


def placed(placement: tuple[int, int] | None) -> str:
    if placement is None:
        return "not pinned: a server not started here, or one CPU"
    return f"this process on CPU {placement[0]}, the server and the echo process on CPU {placement[1]}"


# -- cost per key -----------------------------------------------------------------------------


#: ``lookup_p50s(distinct=True)``: key lists start at this many different keys in turn, more
#: lists than the client's and the server's caches of repeated key lists keep
DISTINCT_STARTS = 1024


def lookup_p50s(
    url: str, short: int, long: int, requests: int, distinct: bool = False, release: bool = False
) -> tuple[float, float]:
    """p50 in microseconds of sequential LOOKUPs of ``short`` and of ``long`` keys, all in L1,
    measured in alternating rounds so that both see the same machine.  The same key list
    every time (an engine asking again for a waiting request's prefix), or with
    ``distinct`` a list that starts one key further each time (a new prefix each time).
    With ``release``, the RELEASE of the keys each LOOKUP locked is timed instead (an
    engine done with a prompt: every lock a lookup takes is given back this way)."""
    total = long + (DISTINCT_STARTS if distinct else 0)
    keys = slope_keys(total)
    samples: dict[int, list[float]] = {short: [], long: []}
    starts = itertools.cycle(range(DISTINCT_STARTS if distinct else 1))
    with Client(url) as client:
        client.store(keys, [bytes(4096)] * total, l1_only=True)
        try:
            rounds = 10
            for _ in range(rounds):
                for count in (short, long):
                    per_round = max(1, requests * short // (count * rounds))
                    for _ in range(per_round):
                        first = next(starts)
                        wanted = keys[first : first + count]
                        start = time.perf_counter_ns()
                        hits = client.lookup(wanted)
                        if release:
                            start = time.perf_counter_ns()
                            client.release(wanted)
                        samples[count].append((time.perf_counter_ns() - start) / 1e3)
                        if hits != count:
                            raise SystemExit(f"LOOKUP found {hits} of {count} keys stored in L1")
        finally:
            client.release(keys)
            client.evict(keys)
    return statistics.median(samples[short]), statistics.median(samples[long])


def unseen_lookup_p50s(url: str, short: int, long: int, requests: int) -> tuple[float, float]:
    """p50 in microseconds of sequential LOOKUPs of ``short`` and of ``long`` keys nobody
    stored or named before (a new prompt): every request names keys of its own, made
    before its clock starts, and finds none of them.  Measured in alternating rounds, as
    ``lookup_p50s``."""
    samples: dict[int, list[float]] = {short: [], long: []}
    salt = f"bench-unseen-{os.getpid()}"
    made = itertools.count()
    with Client(url) as client:
        rounds = 10
        for _ in range(rounds):
            for count in (short, long):
                for _ in range(max(1, requests * short // (count * rounds))):
                    wanted = [
                        ObjectKey("bench-slope", 0, next(made).to_bytes(8, "big") * 4, 0, salt)
                        for _ in range(count)
                    ]
                    start = time.perf_counter_ns()
                    hits = client.lookup(wanted)
                    samples[count].append((time.perf_counter_ns() - start) / 1e3)
                    if hits:
                        raise SystemExit(f"LOOKUP found {hits} of {count} keys nobody stored")
    return statistics.median(samples[short]), statistics.median(samples[long])


# -- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument(
        "--url", help="benchmark this running server instead of starting one (the floor is measured here)"
    )
    parser.add_argument(
        "--transport",
        choices=("tcp", "ipc"),
        default="tcp",
        help="endpoint of the server started here and of the echo floor (tcp is the default users run)",
    )
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lookup-keys", type=int, default=16)
    parser.add_argument("--lookup-requests", type=int, default=20_000)
    parser.add_argument(
        "--long-lookup-keys",
        type=int,
        default=512,
        help="keys of the long LOOKUP whose p50 next to the short one's gives the cost per key (0: skip)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--l2", choices=("nixl", "fs"), help="L2 adapter of the server started here")
    parser.add_argument("--direct", action="store_true", help="the L2 writes with O_DIRECT")
    parser.add_argument("--clients", type=int, default=0, help="processes of the multi-client STORE")
    parser.add_argument(
        "--client-chunk-kib",
        default="256,1024,4096,16384",
        help="chunk sizes of the multi-client STORE, KiB, comma-separated",
    )
    parser.add_argument("--client-mib", type=int, default=64, help="MiB each client stores per repeat")
    parser.add_argument("--echo-server", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        echo_server(args.echo_server)
        return

    chunk_bytes = int(args.chunk_mib * (1 << 20))
    proc = None
    url = args.url
    transport = "ipc" if url is not None and url.startswith("ipc://") else args.transport
    l2_root = tempfile.mkdtemp(prefix="lmcache-tiers-bench-l2-", dir=os.getcwd()) if args.l2 else ""
    if url is None:
        # room for one batch plus slack, since eviction is what frees space between repeats;
        # with L2, for every write-back batch too (unstored objects are never evicted)
        batch_gb = args.chunks * chunk_bytes / 2**30
        l1_gb = max(0.5, (3 + (args.repeats if args.l2 else 0)) * batch_gb)
        if args.clients:
            l1_gb = max(l1_gb, 3 * args.clients * args.client_mib / 1024)
        adapters = (
            [l2_adapter_json(args.l2, l2_root, 4 * args.repeats * batch_gb + 1, direct=args.direct)]
            if args.l2
            else []
        )
        try:
            proc, url = start_server(l1_gb, transport, adapters)
        except BaseException:
            if l2_root:
                shutil.rmtree(l2_root, ignore_errors=True)
            raise
    extra = StoreFigures()
    try:
        floor_keys = run_bench_keys(args.lookup_keys)
        floor_before = measure_floor(transport, floor_keys)
        result = run_with_progress(
            url,
            show=not args.json,
            chunks=args.chunks,
            chunk_bytes=chunk_bytes,
            repeats=args.repeats,
            lookup_keys=args.lookup_keys,
            lookup_requests=args.lookup_requests,
        )
        floor_after = measure_floor(transport, floor_keys)
        alternating = lookup_against_floor(
            url, transport, args.lookup_keys, args.lookup_requests, None if proc is None else proc.pid
        )
        bare = bare_requests(
            url, transport, args.lookup_keys, args.lookup_requests // 2, None if proc is None else proc.pid
        )
        slope = None
        distinct_slope = release_slope = unseen_slope = (0.0, 0.0)
        if args.long_lookup_keys > args.lookup_keys:
            long_keys = args.long_lookup_keys
            short_p50, long_p50 = lookup_p50s(url, args.lookup_keys, long_keys, args.lookup_requests)
            # Both echo ends with the keys of lookup_p50s, one right after the other: the
            # floor's per-key cost is of the same key bytes, taken under the same load.
            echo_short = measure_floor(transport, slope_keys(args.lookup_keys))
            echo_long = measure_floor(transport, slope_keys(args.long_lookup_keys))
            slope = (short_p50, long_p50, echo_short[1], echo_long[1])
            distinct_slope = lookup_p50s(
                url, args.lookup_keys, long_keys, args.lookup_requests, distinct=True
            )
            release_slope = lookup_p50s(
                url, args.lookup_keys, long_keys, args.lookup_requests, distinct=True, release=True
            )
            unseen_slope = unseen_lookup_p50s(url, args.lookup_keys, long_keys, args.lookup_requests)
        if args.l2:
            extra.write_back = store_under_write_back(url, args.chunks, chunk_bytes, args.repeats)
        if args.clients:
            sizes = [int(kib) << 10 for kib in args.client_chunk_kib.split(",") if kib]
            extra.clients = store_many_clients(url, args.clients, sizes, args.client_mib << 20, args.repeats)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        if l2_root:
            shutil.rmtree(l2_root, ignore_errors=True)
    floor_per_s = max(floor_before[0], floor_after[0])
    if args.json:
        data = result.to_dict()
        data["transport"] = transport
        data["zmq_echo_per_s"] = [floor_before[0], floor_after[0]]
        data["zmq_echo_p50_us"] = [floor_before[1], floor_after[1]]
        data["lookup_vs_zmq_echo"] = result.lookup_per_s / floor_per_s
        data["lookup_vs_zmq_echo_alternating"] = alternating[0]
        data["alternating_lookup_echo_per_s"] = [alternating[1], alternating[2]]
        data["alternating_cpus_client_server"] = list(alternating[3]) if alternating[3] else None
        data["bare_socket_ping_lookup_p50_us"] = list(bare[:2])
        data["bare_socket_echo_ping_lookup_p50_us"] = list(bare[2:])
        if slope is not None:
            added = args.long_lookup_keys - args.lookup_keys
            data["long_lookup_keys"] = args.long_lookup_keys
            data["lookup_short_long_p50_us"] = [slope[0], slope[1]]
            data["zmq_echo_short_long_p50_us"] = [slope[2], slope[3]]
            data["lookup_us_per_extra_key"] = (slope[1] - slope[0]) / added
            data["zmq_echo_us_per_extra_key"] = (slope[3] - slope[2]) / added
            data["lookup_distinct_short_long_p50_us"] = list(distinct_slope)
            data["lookup_distinct_us_per_extra_key"] = (distinct_slope[1] - distinct_slope[0]) / added
            data["release_short_long_p50_us"] = list(release_slope)
            data["release_us_per_extra_key"] = (release_slope[1] - release_slope[0]) / added
            data["lookup_unseen_short_long_p50_us"] = list(unseen_slope)
            data["lookup_unseen_us_per_extra_key"] = (unseen_slope[1] - unseen_slope[0]) / added
        data.update(extra.to_dict(args.l2, args.direct))
        print(json.dumps(data, indent=2))
        return
    stdout.print(bench_table(result))
    store, retrieve = result.ratio(result.store_gbps), result.ratio(result.retrieve_gbps)
    keys = f"{result.lookup_keys} keys"
    lines = [
        f"STORE (shared memory): {store:.2f} x memcpy (target >= {STORE_TARGET})"
        if store is not None
        else "STORE (shared memory): not available from here",
        f"RETRIEVE (shared memory): {retrieve:.2f} x memcpy (target >= {STORE_TARGET})"
        if retrieve is not None
        else "RETRIEVE (shared memory): not available from here",
        f"LOOKUP {keys}, sequential: {result.lookup_per_s:,.0f} req/s "
        f"(target >= {LOOKUP_TARGET_PER_S:,}; transport floor this run {floor_per_s:,.0f})",
        f"LOOKUP {keys}, p50 / p99: {result.lookup_p50_us:.0f} / {result.lookup_p99_us:.0f} us "
        f"(transport floor p50 this run {min(floor_before[1], floor_after[1]):.0f} us)",
        f"LOOKUP {keys}, {result.lookup_window} in flight: {result.lookup_pipelined_per_s:,.0f} req/s "
        f"(target >= {LOOKUP_TARGET_PER_S:,})",
        f"bare ZeroMQ round trip over {transport}, before / after: "
        f"{floor_before[0]:,.0f} / {floor_after[0]:,.0f} req/s "
        f"(LOOKUP reaches {result.lookup_per_s / floor_per_s:.2f}x of the better one)",
        f"LOOKUP {keys} against the bare round trip in alternating rounds: {alternating[0]:.2f}x "
        f"(median of {FLOOR_ROUNDS} pairs; {alternating[1]:,.0f} vs {alternating[2]:,.0f} req/s; "
        f"{placed(alternating[3])}; target >= {LOOKUP_FLOOR_TARGET}x)",
        f"the same through a bare DEALER socket, no client library, placed as the alternating rounds: "
        f"PING p50 {bare[0]:.0f} us, LOOKUP {keys} p50 {bare[1]:.0f} us; the echo process answering "
        f"the same bytes {bare[2]:.0f} / {bare[3]:.0f} us",
    ]
    if slope is not None:
        added = args.long_lookup_keys - args.lookup_keys
        lines.append(
            f"LOOKUP cost per extra key ({args.long_lookup_keys} vs {args.lookup_keys} keys, p50 "
            f"{slope[1]:.0f} vs {slope[0]:.0f} us): {(slope[1] - slope[0]) / added:.3f} us "
            f"(target <= {PER_KEY_TARGET_US}; the bare round trip's own per key this run "
            f"{(slope[3] - slope[2]) / added:.3f} us)",
        )
        lines.append(
            f"the same with a different key list each time (p50 {distinct_slope[1]:.0f} vs "
            f"{distinct_slope[0]:.0f} us): {(distinct_slope[1] - distinct_slope[0]) / added:.3f} us"
        )
        lines.append(
            f"the same with keys nobody stored or named before, all misses (p50 {unseen_slope[1]:.0f} "
            f"vs {unseen_slope[0]:.0f} us): {(unseen_slope[1] - unseen_slope[0]) / added:.3f} us"
        )
        lines.append(
            f"RELEASE of what a LOOKUP of stored keys locked, cost per extra key (p50 "
            f"{release_slope[1]:.0f} vs {release_slope[0]:.0f} us): "
            f"{(release_slope[1] - release_slope[0]) / added:.3f} us"
        )
    print("\n".join(lines + extra.lines(args.l2, args.direct)))


if __name__ == "__main__":
    main()
