"""A client's exit is seen through a pidfd whatever its number.

A server with many connections has descriptors numbered past 1024, where ``select``
raises (FD_SETSIZE): the sweep's look at a watched client's pidfd failed there, and the
fences of exited clients stayed.  A real client process maps a file standing in for the
arena; the descriptors below 1100 are taken first, so its pidfd is numbered past 1024.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_plugin_frontend_native.writers import WriterProcesses

from lmcache_tiers.peer_scan import PeerWatch

#: maps argv[1], says so, then waits to be killed
MAPPER = """
import mmap, sys, time
with open(sys.argv[1], "r+b") as f:
    mapped = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
time.sleep(3600)
"""
HIGH_FD = 1100


@pytest.fixture
def descriptors_past_high_fd() -> Iterator[None]:
    """A soft limit on open files above HIGH_FD (many machines start at 1024), put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = HIGH_FD + 64
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"open files limited to {hard}")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("descriptors_past_high_fd")
def test_a_pidfd_numbered_past_1024_tells_the_exit(tmp_path: Path) -> None:
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    found = arena.stat()
    writer = subprocess.Popen([sys.executable, "-c", MAPPER, str(arena)], stdout=subprocess.PIPE, text=True)
    filler = os.open(os.devnull, os.O_RDONLY)
    taken = [filler]
    processes = WriterProcesses(found.st_dev, found.st_ino, lambda identity: True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "mapped"
        while taken[-1] < HIGH_FD:
            taken.append(os.dup(filler))
        processes.hello(b"writer", writer.pid)
        kept: list[PeerWatch | None] = []
        processes.note(b"writer", kept, None)  # it reserves: the kernel names no process
        assert not processes.exited(b"writer", kept)  # its pidfd opened now, past 1024
        writer.kill()
        writer.wait()
        assert processes.exited(b"writer", kept)
    finally:
        processes.close()
        for fd in taken:
            os.close(fd)
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        assert writer.stdout is not None
        writer.stdout.close()
