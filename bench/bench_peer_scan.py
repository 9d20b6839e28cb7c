"""Wall time of one loopback TCP peer lookup (``lmcache_tiers.peer_process.peer_pids``) by
the number of processes on the host.

A client process connects to a listener of this one over 127.0.0.1; the server's end
asks the kernel for the client's process, as the LMCache front end does for each new
loopback connection: ``sock_diag`` (else ``/proc/net/tcp``) for the client socket's inode, then every
process's ``/proc/<pid>/fd`` for its holder.  ``--sleepers`` extra processes (``sleep``,
each with its three standard descriptors) are started for each figure, on top of what
the host runs.  The figures are medians of ``--repeat`` lookups: the whole lookup (the
scan, which the front end runs on its worker thread) and the part its loop thread runs
(``peer_socket``: the connection's addresses, no scan).

    python bench/bench_peer_scan.py [--sleepers 0,500] [--repeat 20]
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time

from bench_args import BenchParser, at_least_one

from lmcache_tiers.peer_process import peer_pids, peer_socket

_CLIENT = (
    "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); sys.stdin.read()"
)


def host_counts() -> tuple[int, int]:
    """(processes, descriptors this user can see) on the host."""
    processes = descriptors = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        processes += 1
        try:
            descriptors += len(os.listdir(f"/proc/{entry.name}/fd"))
        except OSError:
            continue
    return processes, descriptors


def measure(repeat: int) -> tuple[float, float]:
    """Median seconds of one lookup of a client process's loopback connection, and of
    its loop-thread part."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = subprocess.Popen([sys.executable, "-c", _CLIENT, str(port)], stdin=subprocess.PIPE)
        try:
            conn, _ = listener.accept()
            with conn:
                times, loop_times = [], []
                for _ in range(repeat):
                    start = time.perf_counter()
                    peer_socket(conn.fileno())
                    loop_times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    found = peer_pids(conn.fileno())
                    times.append(time.perf_counter() - start)
                    if found != (client.pid,):
                        raise SystemExit(f"lookup found {found}, not the client {client.pid}")
                return statistics.median(times), statistics.median(loop_times)
        finally:
            assert client.stdin is not None
            client.stdin.close()
            client.wait()


def main() -> None:
    parser = BenchParser(description=__doc__)
    parser.add_argument("--sleepers", default="0,500", help="comma-separated extra process counts")
    parser.add_argument("--repeat", type=at_least_one, default=20)
    args = parser.parse_args()
    for count in [int(part) for part in args.sleepers.split(",")]:
        sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
        try:
            processes, descriptors = host_counts()
            scan, loop = measure(args.repeat)
            print(
                f"+{count:5d} sleepers: {processes:5d} processes, {descriptors:6d} descriptors: "
                f"scan {scan * 1e3:7.2f} ms, loop thread {loop * 1e6:6.1f} us (medians of {args.repeat})",
                flush=True,
            )
        finally:
            for sleeper in sleepers:
                sleeper.kill()
            for sleeper in sleepers:
                sleeper.wait()


if __name__ == "__main__":
    main()
