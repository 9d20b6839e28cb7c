"""A client in a pid namespace the server cannot see, or on another host, keeps its fences
until it commits or aborts: its HELLO pid is never watched.

``SO_PEERCRED`` gives pid 0 for a client whose process has no pid in the server's
namespace (the server in a container, the client outside it).  The HELLO pid then stood
in, though it is of the client's namespace: naming a process of the server's namespace
that maps the arena, that process's exit lifted the fence while the writer could still
copy.  The server runs here in a pid namespace of its own (``unshare``), the client
outside it, over ``ipc://``: the real case.  A TCP peer off loopback is another host's
process, which cannot map the arena, or one behind another network namespace, most likely
in another pid namespace too: its HELLO pid names nothing here either.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lmcache_plugin_frontend_native.writers import WriterProcesses
from native_fence_support import CHUNK
from test_writer_kernel_pid import LYING_WRITER

from lmcache_tiers.plugin import PeerSocket, PeerWatch
from lmcache_tiers.testing.children import FILE_MAPPER, end, says
from lmcache_tiers.testing.children import start_script as start

SERVER = Path(__file__).with_name("foreign_namespace_server.py")


def can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not can_unshare_pid(), reason="needs unshare --pid (root or user namespaces)")
def test_the_fence_of_a_client_in_a_foreign_pid_namespace_outlives_the_process_its_hello_names(
    tmp_path: Path,
) -> None:
    server = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(SERVER), str(tmp_path / "n.sock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    writer = None
    try:
        assert server.stdout is not None and server.stdin is not None
        endpoint, named_pid = server.stdout.readline().split()
        # Greets with a pid of the server's namespace mapping the arena, as a pid of the
        # client's own namespace may happen to be.
        writer = subprocess.Popen(
            [sys.executable, "-c", LYING_WRITER, endpoint, str(CHUNK), named_pid],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        says(writer, "reserved")
        server.stdin.write("reserved\n")
        server.stdin.flush()
        assert server.stdout.readline().split() == ["fenced", "1", "foreign", "1"]
    finally:
        if writer is not None:
            end(writer)
        server.wait(timeout=60)
        for stream in (server.stdin, server.stdout):
            if stream is not None:
                stream.close()
    assert server.returncode == 0


def test_the_hello_pid_of_a_peer_off_loopback_is_never_watched(tmp_path: Path) -> None:
    """The kernel's answer for a TCP peer off loopback (injected: no second host here) and
    a HELLO pid naming a live process of this namespace mapping the arena."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    info = os.stat(arena)
    writers = WriterProcesses(info.st_dev, info.st_ino, lambda identity: True)
    named = start(FILE_MAPPER, str(arena))
    try:
        says(named, "mapped")
        writers.hello(b"remote", named.pid)
        writers.note(b"remote", [], None)  # it reserves: the pid it told is the one kept
        remote = PeerWatch(PeerSocket(far=("10.1.2.3", 40000), near=("10.1.2.4", 5555)))
        remote.arm(None)
        unknown = None  # the kernel gave no answer at all: the HELLO pid stands in
        assert not writers.exited(b"remote", [remote])
        assert not writers.exited(b"remote", [unknown])
        end(named)
        assert not writers.exited(b"remote", [remote])  # the fence stays
        assert writers.exited(b"remote", [unknown])
    finally:
        if named.poll() is None:
            end(named)
        writers.close()
