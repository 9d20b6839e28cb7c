"""The process at the other end of a connection, read from the kernel, and its exit.

Real client processes connect over a Unix socket and loopback TCP (IPv4 and IPv6); the
server side's descriptor names them, and a pidfd tells when they have exited.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.peer_process import (
    PeerProcess,
    PeerSocket,
    maps_file,
    peer_pids,
    peer_socket,
    watch_peer,
    watch_peer_socket,
)

#: connects to argv[1] (a path, or host:port), says so, then waits to be killed
CLIENT = """
import socket, sys, time
where = sys.argv[1]
if where.startswith("/"):
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(where)
else:
    host, port = where.rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)))
print("connected", flush=True)
time.sleep(3600)
"""


def start_client(where: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", CLIENT, where], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "connected"
    return process


def stop(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()
    assert process.stdout is not None
    process.stdout.close()


def host_address() -> str:
    """An IPv4 address of this host off loopback (the test is skipped where it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: it only picks a route
        except OSError:
            pytest.skip("this host has no route off loopback")
        address = str(probe.getsockname()[0])
    if address.startswith("127."):
        pytest.skip("this host has no address off loopback")
    return address


@pytest.fixture(params=["unix", "tcp4", "tcp6", "tcp-host-address"])
def accepted(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[socket.socket, subprocess.Popen[str]]]:
    """The server side of a connection from a client process, and that process."""
    if request.param == "unix":
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "s"))
        where = str(tmp_path / "s")
    elif request.param in ("tcp4", "tcp-host-address"):
        # the host's own address: a client here connecting to it rather than 127.0.0.1
        host = "127.0.0.1" if request.param == "tcp4" else host_address()
        listener = socket.socket(socket.AF_INET)
        listener.bind((host, 0))
        where = f"{host}:{listener.getsockname()[1]}"
    else:
        listener = socket.socket(socket.AF_INET6)
        listener.bind(("::1", 0))
        where = f"[::1]:{listener.getsockname()[1]}"
    listener.listen()
    process = start_client(where)
    conn, _ = listener.accept()
    try:
        yield conn, process
    finally:
        if process.poll() is None:
            stop(process)
        conn.close()
        listener.close()


def test_the_peer_process_is_named_and_its_exit_seen(
    accepted: tuple[socket.socket, subprocess.Popen[str]],
) -> None:
    conn, process = accepted
    assert peer_pids(conn.fileno()) == (process.pid,)
    watch = watch_peer(conn.fileno())
    assert watch is not None
    exits_with(watch, process)


def test_a_peer_read_at_once_is_watched_later_after_its_descriptor_closed(
    accepted: tuple[socket.socket, subprocess.Popen[str]],
) -> None:
    """A server reads what the kernel says of a connection at once and scans for its
    process on another thread, later: by then the descriptor may be closed (and its
    number another connection's), so the scan must need only what was read."""
    conn, process = accepted
    peer = peer_socket(conn.fileno())
    assert peer is not None
    conn.close()  # the client still holds its end
    watch = watch_peer_socket(peer)
    assert watch is not None and watch.pids == (process.pid,)
    exits_with(watch, process)


def exits_with(watch: PeerProcess, process: subprocess.Popen[str]) -> None:
    """``watch`` says exited once ``process`` has, not before (closed after)."""
    try:
        assert not watch.exited()
        stop(process)
        assert watch.exited()
    finally:
        watch.close()


def test_a_peer_socket_is_none_for_a_descriptor_naming_no_connection() -> None:
    assert peer_socket(-1) is None
    with socket.socket(socket.AF_INET) as unconnected:
        assert peer_socket(unconnected.fileno()) is None


@contextlib.contextmanager
def unix_peer(tmp_path: Path) -> Iterator[tuple[socket.socket, subprocess.Popen[str]]]:
    """A client process connected over a Unix socket, and the server side of its connection."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "s"))
    listener.listen()
    process = start_client(str(tmp_path / "s"))
    conn, _ = listener.accept()
    with listener, conn:
        try:
            yield conn, process
        finally:
            if process.poll() is None:
                stop(process)


def test_a_peer_that_exited_before_the_watch_began_has_exited(tmp_path: Path) -> None:
    with unix_peer(tmp_path) as (conn, process):
        stop(process)  # reaped: its pid names nothing now
        watch = watch_peer(conn.fileno())
        assert watch is not None and watch.exited()


def test_a_descriptor_naming_no_connection_names_no_process() -> None:
    assert peer_pids(-1) == ()
    assert watch_peer(-1) is None
    read_end, write_end = os.pipe()
    try:
        assert peer_pids(read_end) == ()
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_descriptor_of_another_file_leaves_no_descriptor_open() -> None:
    read_end, write_end = os.pipe()
    try:
        gc.collect()  # earlier tests' garbage collected meanwhile would close its descriptors
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            assert peer_socket(read_end) is None
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_peer_of_the_same_process_is_this_process() -> None:
    left, right = socket.socketpair()
    with left, right:
        assert peer_pids(left.fileno()) == (os.getpid(),)


def test_a_closed_watch_never_says_exited(tmp_path: Path) -> None:
    with unix_peer(tmp_path) as (conn, process):
        watch = watch_peer(conn.fileno())
        assert watch is not None
        watch.close()
        stop(process)
        assert not watch.exited()  # it can no longer tell: never taken as over


def test_maps_file_names_only_a_process_mapping_the_file(tmp_path: Path) -> None:
    mapped = tmp_path / "arena"
    mapped.write_bytes(bytes(4096))
    info = os.stat(mapped)
    mapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys\nf = open(sys.argv[1], 'r+b')\nm = mmap.mmap(f.fileno(), 4096)\n"
            "print('mapped', flush=True)\nsys.stdin.read()",
            str(mapped),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert mapper.stdout is not None and mapper.stdout.readline().strip() == "mapped"
        assert maps_file((mapper.pid,), info.st_dev, info.st_ino)
        assert maps_file((os.getpid(), mapper.pid), info.st_dev, info.st_ino)
        assert not maps_file((os.getpid(),), info.st_dev, info.st_ino)
    finally:
        mapper.kill()
        mapper.wait()
        for stream in (mapper.stdin, mapper.stdout):
            if stream is not None:
                stream.close()
    assert not maps_file((mapper.pid,), info.st_dev, info.st_ino)  # gone: not known to map it


def test_maps_file_is_not_fooled_by_a_file_named_after_the_device_and_inode(tmp_path: Path) -> None:
    """The maps line's path is any name, spaces kept: a process mapping a file whose name
    holds " <device> <inode> " of the arena does not map the arena."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    info = os.stat(arena)
    decoy = tmp_path / f"x {os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x} {info.st_ino} y"
    decoy.write_bytes(bytes(4096))
    with open(decoy, "r+b") as file, mmap.mmap(file.fileno(), 4096):
        assert not maps_file((os.getpid(),), info.st_dev, info.st_ino)


def test_maps_file_names_a_process_mapping_the_file_after_its_unlink(tmp_path: Path) -> None:
    """A segment unlinked while mapped shows its path "(deleted)": its device and inode
    still name it."""
    arena = tmp_path / "arena"
    arena.write_bytes(bytes(4096))
    info = os.stat(arena)
    with open(arena, "r+b") as file, mmap.mmap(file.fileno(), 4096):
        arena.unlink()
        assert maps_file((os.getpid(),), info.st_dev, info.st_ino)


def test_a_tcp_peer_off_loopback_is_remote() -> None:
    assert PeerSocket(far=("10.1.2.3", 5), near=("10.1.2.4", 6)).remote
    assert not PeerSocket(far=("127.0.0.1", 5), near=("127.0.0.1", 6)).remote
    assert not PeerSocket(far=("::ffff:127.0.0.1", 5, 0, 0), near=("::1", 6, 0, 0)).remote
    assert not PeerSocket(pid=7).remote and not PeerSocket(foreign=True).remote
    # a client of this host connecting to the host's own address: the kernel routes it
    # locally, from that address, and its socket is in this namespace's /proc/net/tcp
    assert not PeerSocket(far=("10.1.2.3", 5), near=("10.1.2.3", 6)).remote
