"""A connection's watch is shared with an earlier one of the same pids only while every
process that earlier watch names lives.

A connection whose socket two processes hold (a client and a child it forked) is watched
through both pidfds, exited once both have.  Once one of them exited, its pid may name a
new process (the kernel hands pids out again once the pid space wraps); a later
connection held by that new process and the survivor reads as the same pids.  Given the
earlier watch, the later connection's writer was taken as exited when the survivor
exited, while the new process holding it lived and could still copy.

The kernel's reuse of a pid is stood in for by the scanner: the second lookup names the
same pids, the exited one's number now watched through a pidfd of another live process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from lmcache_tiers.peer_process import PeerProcess, PeerSocket
from lmcache_tiers.peer_scan import ConnectionPeers
from lmcache_tiers.testing.peer_scans import GATE_S

SLEEPER = "import time; time.sleep(3600)"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    for _ in range(3):
        started.append(subprocess.Popen([sys.executable, "-c", SLEEPER]))
    yield started
    for process in started:
        process.kill()
        process.wait()


def test_a_watch_whose_pid_went_to_another_process_is_not_shared(
    processes: list[subprocess.Popen[bytes]],
) -> None:
    child, survivor, newcomer = processes
    pids = (child.pid, survivor.pid)
    found = [
        # the first connection: the client and the child it forked
        PeerProcess(pids, [os.pidfd_open(child.pid), os.pidfd_open(survivor.pid)]),
        # the second: the survivor, and a new process the child's pid names now
        PeerProcess(pids, [os.pidfd_open(newcomer.pid), os.pidfd_open(survivor.pid)]),
    ]

    def scanner(peer: PeerSocket) -> PeerProcess | None:
        return found.pop(0)

    connections = ConnectionPeers(scanner)
    first, second = socket.socketpair(), socket.socketpair()
    try:
        earlier = connections.watch(first[0].fileno())
        assert earlier is not None and earlier.armed.wait(GATE_S)
        child.kill()
        child.wait()
        later = connections.watch(second[0].fileno())
        assert later is not None and later.armed.wait(GATE_S)
        survivor.kill()
        survivor.wait()
        assert earlier.exited()  # both its processes have exited
        assert not later.exited(), "the writer of the later connection lives"
        newcomer.kill()
        newcomer.wait()
        assert later.exited()
    finally:
        connections.close()
        for pair in (first, second):
            for end in pair:
                end.close()
