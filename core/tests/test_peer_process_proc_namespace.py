"""The loopback TCP lookup's /proc: of another pid namespace it names no peer, and the
server's own descriptors are not read.

A server started in a new pid namespace without a /proc of its own (``unshare --pid
--fork`` without ``--mount-proc``) reads the pids of the namespace /proc was mounted for,
which mean nothing (or another process) to pidfd_open here: the lookup says unknown
rather than watch the wrong process, or none and call the peer exited.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest

from lmcache_tiers.peer_process import peer_pids

#: a loopback TCP connection whose client end a live child process holds
PROBE = """
import socket, subprocess, sys
from lmcache_tiers.peer_process import watch_peer
listener = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(listener.getsockname())
server_side, _ = listener.accept()
holder = subprocess.Popen(
    [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, pass_fds=[client.fileno()]
)
client.close()
watch = watch_peer(server_side.fileno())
print("unknown" if watch is None else ("exited" if watch.exited() else "alive"))
holder.stdin.close()
holder.wait()
"""


def test_a_proc_of_another_pid_namespace_names_no_peer() -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    command = [unshare, "--pid", "--fork"]
    if subprocess.run([*command, "true"], capture_output=True).returncode != 0:
        command = [unshare, "--user", "--map-root-user", "--pid", "--fork"]
        if subprocess.run([*command, "true"], capture_output=True).returncode != 0:
            pytest.skip("no new pid namespace here")
    result = subprocess.run(
        [*command, sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "unknown", result.stderr


def test_the_proc_of_this_namespace_names_the_peer() -> None:
    """The same probe in the server's own namespace: the peer is told, and alive."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "alive", result.stderr


def test_a_client_in_the_servers_own_process_is_not_looked_for() -> None:
    """The scan skips the server's own descriptors (they grow with its connections): a
    client socket only the server's process holds names nobody, so is never watched."""
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_connection(listener.getsockname()):
        server_side, _ = listener.accept()
        with server_side:
            assert peer_pids(server_side.fileno()) == ()
