"""The fence of a client's expired reservation waits for the process known for its routing
identity when the reservation was made, never for one that greets the server under that
identity later.

Behind a relay the kernel names no writer (the relay maps no arena), and the pid the
client's HELLO reported stands in.  It was read only when first needed -- at the first
sweep after the reservation was fenced, or at a commit naming the reservation from
another identity -- so a second process that took over the routing identity (a peer
chooses it) after the first one's connection dropped, and greeted the server with its own
pid, was watched in the writer's place: its exit lifted the writer's fence, and its
commit over a connection of its own gave the fenced extent back, while the writer lived
and could still copy into the extent (wrong bytes in whatever L1 put there next).

Every process here is a real one: the relay (mapping no arena), the writer and the
newcomer (both mapping the arena, as clients do).  Where no pid was told when the
reservation was made, none greeted later is waited for either: the fence stays until
the client's commit or abort, as for a client the kernel cannot name.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from lmcache_plugin_frontend_native.writers import WriterProcesses
from native_fence_support import CHUNK, SHORT_TTL
from native_keys import leases_of, stats_of
from native_stop import wait_for

from lmcache_tiers.peer_process import PeerSocket
from lmcache_tiers.peer_scan import PeerWatch
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.children import (
    FILE_MAPPER,
    TCP_RELAY,
    end,
    line_of,
    start_script,
    tell,
)

#: what both client processes share: the arena mapped, requests over a raw socket
CLIENT = """
import mmap, os, sys, time
import zmq
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p
endpoint, arena, identity, name = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), sys.argv[4]
key = ObjectKey("reserved-as", 0, bytes.fromhex(name))
with open(arena, "r+b") as f:
    mapped = mmap.mmap(f.fileno(), 4096)
context = zmq.Context()
def connect(url, routing_id=None):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(url)
    return sock
def exchange(sock, request):
    sock.send(p.encode(request))
    assert sock.poll(30_000), "no reply"
    return p.reply_decoder.decode(sock.recv_multipart()[0])
def hello():
    return p.Hello(1, "", p.PROTOCOL_VERSION, "reserved-as", os.getpid())
"""

#: greets the server (through the relay, argv[1]) under the identity argv[3], reserves
#: one chunk, then drops its connection when told, living on with the arena mapped
WRITER = (
    CLIENT
    + """
sock = connect(endpoint, identity)
assert isinstance(exchange(sock, hello()), p.HelloReply)
reply = exchange(sock, p.StoreReserve(2, "", [key], [int(sys.argv[5])]))
assert isinstance(reply, p.StoreReserveReply) and reply.slots[0].offset >= 0, reply
print("reserved", flush=True)
sys.stdin.readline()
sock.close(0)
print("dropped", flush=True)
sys.stdin.read()
"""
)

#: takes the identity argv[3] over once the server let the writer's connection go, and
#: greets the server with its own pid; told "commit", commits the writer's key over a
#: connection of its own (its own pid greeted there too) and prints the reply's flags
NEWCOMER = (
    CLIENT
    + """
deadline = time.monotonic() + 30
while True:  # the identity is refused while the server still holds the dropped connection
    sock = connect(endpoint, identity)
    sock.send(p.encode(hello()))
    if sock.poll(500):
        break
    sock.close(0)
    assert time.monotonic() < deadline, "the server never let the dropped identity go"
assert isinstance(p.reply_decoder.decode(sock.recv_multipart()[0]), p.HelloReply)
print("greeted", flush=True)
if sys.stdin.readline().strip() == "commit":
    own = connect(endpoint)
    assert isinstance(exchange(own, hello()), p.HelloReply)
    reply = exchange(own, p.StoreCommit(2, "", [key]))
    assert isinstance(reply, p.StoreReply), reply
    print(reply.done, flush=True)
sys.stdin.read()
"""
)


def native(server: TiersServer) -> Any:
    """The server's only front end, the native one."""
    return server.frontends[0]


def arena_path(server: TiersServer) -> str:
    plane = native(server).data_plane
    return os.path.join(plane.shm_dir or "/dev/shm", plane.shm_name)


def fenced(server: TiersServer) -> int:
    return leases_of(server)["fenced_extents"]


class HeldSweeps:
    """The server's sweeps of the fences of exited writers, held (not run) until
    :meth:`let_go`, then counted: nothing reads the HELLO pid before the newcomer's
    greeting, as a sweep that has not come yet would not."""

    def __init__(self, server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> None:
        handlers = native(server).handlers
        release = handlers.release_fences_of_exited_writers
        self._free = threading.Event()
        self.runs = 0

        def held() -> None:
            if self._free.is_set():
                release()
                self.runs += 1

        monkeypatch.setattr(handlers, "release_fences_of_exited_writers", held)

    def let_go(self) -> None:
        self._free.set()

    def wait_for_two(self) -> None:
        """Two more sweeps: one ran wholly after this call."""
        runs = self.runs
        wait_for(lambda: self.runs >= runs + 2, "two sweeps of the fences")


def found_not_writer(server: TiersServer, identity: bytes) -> bool:
    """Whether the lookup of the connection ``identity`` reserved over ended finding a
    process that maps no arena (counted as ``peer_not_writer`` by the next sweep)."""
    session = native(server).handlers.sessions.peek(identity)
    assert session is not None
    (watch,) = session.writers
    return bool(watch.armed.is_set() and watch.not_writer)


def writer_reserved_through(
    relay_script: str, server: TiersServer, processes: list[subprocess.Popen[str]]
) -> tuple[subprocess.Popen[str], str, str]:
    """A writer that reserved one chunk through a relay running ``relay_script`` (given
    the server's port, printing its own); with the routing identity and key name it used."""
    relay = start_script(relay_script, server.endpoint.rsplit(":", 1)[1], started=processes)
    relayed = f"tcp://127.0.0.1:{line_of(relay)}"
    identity, name = (b"W" + os.urandom(7)).hex(), os.urandom(8).hex()
    writer = start_script(WRITER, relayed, arena_path(server), identity, name, str(CHUNK), started=processes)
    assert line_of(writer) == "reserved"
    return writer, identity, name


def relayed_writer_reserved(
    server: TiersServer, processes: list[subprocess.Popen[str]]
) -> tuple[subprocess.Popen[str], str, str]:
    """A writer that reserved one chunk through a relay, its connection's lookup ended
    (finding the relay, not the writer); with the routing identity and key name it used."""
    writer, identity, name = writer_reserved_through(TCP_RELAY, server, processes)
    wait_for(lambda: found_not_writer(server, bytes.fromhex(identity)), "the relay found, not the writer")
    return writer, identity, name


def writer_fenced_then_dropped(
    server: TiersServer, processes: list[subprocess.Popen[str]], mode: str
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """The writer, reserved through the relay then dropped (alive), and the newcomer
    greeted under its identity, told ``mode``; the writer's reservation fenced."""
    writer, identity, name = relayed_writer_reserved(server, processes)
    tell(writer, "drop")
    assert line_of(writer) == "dropped"
    newcomer = start_script(NEWCOMER, server.endpoint, arena_path(server), identity, name, started=processes)
    assert line_of(newcomer) == "greeted"
    wait_for(lambda: fenced(server) == 1, "the expired reservation fenced")
    tell(newcomer, mode)
    return writer, newcomer


def test_the_exit_of_a_process_greeting_under_the_writers_identity_later_leaves_its_fence(
    make_server: Callable[..., TiersServer],
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server(**SHORT_TTL)
    sweeps = HeldSweeps(server, monkeypatch)
    writer, newcomer = writer_fenced_then_dropped(server, processes, "wait")
    sweeps.let_go()
    sweeps.wait_for_two()
    assert stats_of(server).failures["peer_not_writer"] == 1  # the HELLO pid stands in
    assert fenced(server) == 1
    end(newcomer)
    sweeps.wait_for_two()
    assert fenced(server) == 1, "the fence was lifted while its writer lived"
    end(writer)
    wait_for(lambda: fenced(server) == 0, "the fence of the exited writer lifted")
    assert leases_of(server)["reclaimed_writer_done"] == 1


def test_a_commit_of_a_process_greeting_under_the_writers_identity_later_leaves_its_fence(
    make_server: Callable[..., TiersServer],
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server(**SHORT_TTL)
    HeldSweeps(server, monkeypatch)  # no sweep reads the HELLO pid before the commit
    _, newcomer = writer_fenced_then_dropped(server, processes, "commit")
    assert line_of(newcomer) == "[False]"
    assert fenced(server) == 1, "the fence was given back while its writer lived"
    assert stats_of(server).store_keys_refused["reservation_lost"] == 1


@pytest.fixture
def arena() -> Iterator[str]:
    """A file in /dev/shm, as the server's arena is (its device and inode what the maps
    of a process mapping it name)."""
    path = f"/dev/shm/tiers_reserved_as_{os.getpid()}_{os.urandom(4).hex()}"
    with open(path, "wb") as f:
        f.write(bytes(4096))
    yield path
    os.unlink(path)


def behind_a_relay() -> PeerWatch:
    """The kernel's watch of a connection through a relay: it names no writer."""
    watch = PeerWatch(PeerSocket(pid=1))
    watch.arm(None, not_writer=True)
    return watch


def mapping(arena: str, processes: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    process = start_script(FILE_MAPPER, arena, started=processes)
    assert line_of(process) == "mapped"
    return process


def test_a_reservation_made_with_no_pid_told_waits_for_none_greeted_later(
    arena: str, processes: list[subprocess.Popen[str]]
) -> None:
    newcomer = mapping(arena, processes)
    file = os.stat(arena)
    writers = WriterProcesses(file.st_dev, file.st_ino, lambda identity: True)
    try:
        kept: list[PeerWatch | None] = []
        writers.note(b"client", kept, behind_a_relay())  # no HELLO before it reserved
        writers.hello(b"client", newcomer.pid)
        assert writers.unwatched(b"client", kept), "its fences wait for its commit or abort"
        end(newcomer)
        assert not writers.exited(b"client", kept)
    finally:
        writers.close()


def test_reservations_made_under_two_pids_wait_for_both(
    arena: str, processes: list[subprocess.Popen[str]]
) -> None:
    first, second = mapping(arena, processes), mapping(arena, processes)
    file = os.stat(arena)
    writers = WriterProcesses(file.st_dev, file.st_ino, lambda identity: True)
    try:
        kept: list[PeerWatch | None] = []
        writers.hello(b"client", first.pid)
        writers.note(b"client", kept, behind_a_relay())
        assert not writers.unwatched(b"client", kept)
        writers.hello(b"client", second.pid)
        writers.note(b"client", kept, behind_a_relay())
        end(second)
        assert not writers.exited(b"client", kept), "the first pid's process lives"
        end(first)
        assert writers.exited(b"client", kept)
    finally:
        writers.close()
