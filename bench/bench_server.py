"""Server throughput and latency, each next to its limit measured in the same run.

Starts ``lmcache-tiers serve`` in its own process (L1 only, loopback, a free port) unless
``--url`` names a running server, then runs the ``lmcache-tiers bench`` measurements from
this process: STORE and RETRIEVE of N x S bytes through shared memory and inline, each as
GB/s and as a ratio of a plain memcpy of the same bytes; LOOKUP p50/p99 and requests/s.

    python bench/bench_server.py                       # 64 x 2 MiB, 16-key lookups
    python bench/bench_server.py --chunks 128 --chunk-mib 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from lmcache_tiers.cli.commands_server import bench_table, run_with_progress
from lmcache_tiers.cli.output import stdout
from lmcache_tiers.client import Client, ClientError

STORE_TARGET = 0.5  # of memcpy
LOOKUP_TARGET_PER_S = 10_000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(l1_size_gb: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable, "-m", "lmcache_tiers.cli.main", "serve",
        "--l1-size-gb", str(l1_size_gb), "--no-default-l2", "--port", str(port), "--metrics-port", "0",
    ]  # fmt: skip
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    url = f"tcp://127.0.0.1:{port}"
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="benchmark this running server instead of starting one")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lookup-keys", type=int, default=16)
    parser.add_argument("--lookup-requests", type=int, default=20_000)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    chunk_bytes = int(args.chunk_mib * (1 << 20))
    proc = None
    url = args.url
    if url is None:
        # room for one batch plus slack, since eviction is what frees space between repeats
        l1_gb = max(0.5, 3 * args.chunks * chunk_bytes / 2**30)
        proc, url = start_server(l1_gb)
    try:
        result = run_with_progress(
            url,
            show=not args.json,
            chunks=args.chunks,
            chunk_bytes=chunk_bytes,
            repeats=args.repeats,
            lookup_keys=args.lookup_keys,
            lookup_requests=args.lookup_requests,
        )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    stdout.print(bench_table(result))
    store, retrieve = result.ratio(result.store_gbps), result.ratio(result.retrieve_gbps)
    verdicts = [
        f"STORE/memcpy {store:.2f} (target >= {STORE_TARGET})"
        if store is not None
        else "STORE: no shared memory",
        f"RETRIEVE/memcpy {retrieve:.2f} (target >= {STORE_TARGET})" if retrieve is not None else "",
        f"LOOKUP {result.lookup_per_s:,.0f}/s sequential, {result.lookup_pipelined_per_s:,.0f}/s with "
        f"{result.lookup_window} in flight (target >= {LOOKUP_TARGET_PER_S:,}/s)",
    ]
    print("; ".join(v for v in verdicts if v))


if __name__ == "__main__":
    main()
