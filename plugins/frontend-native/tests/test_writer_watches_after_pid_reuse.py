"""A session's writers keep the watch of each connection whose processes are not all the
live processes of one kept before.

A client's connections held by the same processes add one watch to its session's
writers, so its fences wait for those processes once.  Once one of the processes of a
watch kept (a forked child holding the socket too) exited, its pid may name a new
process (the kernel hands pids out again once the pid space wraps): a later connection
held by that process and the survivor reads as the same pids.  Its watch was dropped as
the kept one's, so the fences were lifted at the survivor's exit while the new process
lived and could still copy.

The kernel's reuse of a pid is stood in for by the watches: the later one names the
same pids, the exited one's number watched through a pidfd of another live process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from lmcache_plugin_frontend_native.writers import WriterProcesses

from lmcache_tiers.peer_process import PeerProcess, PeerSocket
from lmcache_tiers.peer_scan import PeerWatch

SLEEPER = "import time; time.sleep(3600)"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started = [subprocess.Popen([sys.executable, "-c", SLEEPER]) for _ in range(3)]
    yield started
    for process in started:
        process.kill()
        process.wait()


def armed(pids: tuple[int, ...], watched: list[int]) -> PeerWatch:
    watch = PeerWatch(PeerSocket(pid=pids[0]))
    watch.arm(PeerProcess(pids, [os.pidfd_open(pid) for pid in watched]))
    return watch


def test_a_later_connection_of_a_pid_gone_to_another_process_is_kept(
    processes: list[subprocess.Popen[bytes]],
) -> None:
    child, survivor, newcomer = processes
    pids = (child.pid, survivor.pid)
    writers = WriterProcesses(0, 0, lambda identity: True)
    try:
        kept: list[PeerWatch | None] = []
        writers.note(b"client", kept, armed(pids, list(pids)))
        child.kill()
        child.wait()
        writers.note(b"client", kept, armed(pids, [newcomer.pid, survivor.pid]))
        survivor.kill()
        survivor.wait()
        assert not writers.exited(b"client", kept), "the process of the later connection lives"
        newcomer.kill()
        newcomer.wait()
        assert writers.exited(b"client", kept)
    finally:
        writers.close()


def test_a_client_holding_a_pid_gone_to_another_process_is_not_taken_for_the_earlier_writer(
    processes: list[subprocess.Popen[bytes]],
) -> None:
    """A commit over a new connection lifts the fences of an earlier identity only if its
    process is the earlier writer's: the same pids, one of which a new process holds now,
    are not."""
    child, survivor, newcomer = processes
    pids = (child.pid, survivor.pid)
    writers = WriterProcesses(0, 0, lambda identity: True)
    try:
        earlier = armed(pids, list(pids))
        child.kill()
        child.wait()
        current = armed(pids, [newcomer.pid, survivor.pid])
        assert not writers.same_process(b"earlier", [earlier], b"client", current)
        assert writers.same_process(b"earlier", [current], b"client", current)  # its own, alive
    finally:
        writers.close()
