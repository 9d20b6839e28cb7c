"""The fence of a client's expired reservations waits for the process the kernel names at
the other end of its connection, not for the pid its HELLO reports.

A HELLO pid is the client's word, in a pid namespace the server may not share: one naming
another process mapping the arena made the server watch that process -- its exit lifted
the fence while the real writer lived and could still copy, and the real writer's exit
lifted nothing.  Each writer here is a process of its own, over loopback TCP, that greets
the server again with a pid that is not its own before it reserves.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
from native_fence_support import CHUNK, SHORT_TTL
from native_keys import leases_of
from native_stop import wait_for

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.children import FILE_MAPPER, end, says
from lmcache_tiers.testing.children import start_script as start

#: greets the server as pid argv[3], reserves one chunk, then stalls until killed
LYING_WRITER = """
import sys
from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p
client = Client(sys.argv[1])
assert client._segment is not None, "the writer did not map the arena"
client._call(p.Hello(0, "", p.PROTOCOL_VERSION, "liar", int(sys.argv[3])), p.HelloReply)
key = ObjectKey("kernel-pid", 0, b"liar0000")
client._call(p.StoreReserve(0, "", [key], [int(sys.argv[2])]), p.StoreReserveReply)
print("reserved", flush=True)
sys.stdin.read()
"""


def arena_path(server: TiersServer) -> str:
    plane = server.frontends[0].data_plane
    return os.path.join(plane.shm_dir or "/dev/shm", plane.shm_name)


def fenced(server: TiersServer) -> int:
    return leases_of(server)["fenced_extents"]


def reserve_as(server: TiersServer, pid: int, started: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    writer = start(LYING_WRITER, server.endpoint, str(CHUNK), str(pid))
    started.append(writer)
    says(writer, "reserved")
    wait_for(lambda: fenced(server) == 1, "the expired reservation fenced")
    return writer


def sweeps_after_now(server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A wait for two more sweeps of the fences (so one ran wholly after this call)."""
    handlers = server.frontends[0].handlers
    release = handlers.release_fences_of_exited_writers
    runs = [0]

    def counted() -> None:
        release()
        runs[0] += 1

    monkeypatch.setattr(handlers, "release_fences_of_exited_writers", counted)
    return lambda: wait_for(lambda: runs[0] >= 2, "two sweeps of the fences")


def test_the_exit_of_the_process_a_hello_names_leaves_the_fence_of_the_real_writer(
    make_server: Any, processes: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(**SHORT_TTL)
    named = start(FILE_MAPPER, arena_path(server))  # maps the arena, as a client would
    processes.append(named)
    says(named, "mapped")
    writer = reserve_as(server, named.pid, processes)
    server.storage.l1.expire_locks(time.monotonic() + 3600.0)
    end(named)
    wait_for_sweeps = sweeps_after_now(server, monkeypatch)
    wait_for_sweeps()
    assert fenced(server) == 1, "the fence was lifted while its writer lived"
    end(writer)
    wait_for(lambda: fenced(server) == 0, "the fence of the exited writer lifted")
    assert leases_of(server)["reclaimed_writer_done"] == 1


def test_the_exit_of_the_real_writer_lifts_the_fence_whatever_its_hello_said(
    make_server: Any, processes: list[subprocess.Popen[str]]
) -> None:
    server = make_server(**SHORT_TTL)
    # The server's own process maps the arena and outlives the test: the pid told is alive.
    writer = reserve_as(server, os.getpid(), processes)
    end(writer)
    wait_for(lambda: fenced(server) == 0, "the fence of the exited writer lifted")
    assert leases_of(server)["reclaimed_writer_done"] == 1


#: a client before 45bf14bd (no HELLO between its copy and its commit) whose connection,
#: through a relay in its own process, is cut between its check of its slots and its copy
OLDER_CLIENT_DROPPED = """
import sys
sys.path.insert(0, sys.argv[2])
import pytest
from native_fence_support import CHUNK, CuttableLink, drop_before_copy
from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
link = CuttableLink(sys.argv[1])
client = Client(link.url)
patches = pytest.MonkeyPatch()
patches.setattr(client, "_greet_again_if_dropped", lambda: None)
drop_before_copy(client, link, patches)
print(client.store([ObjectKey("kernel-pid", 0, b"older000")], [bytes([0x5A]) * CHUNK]), flush=True)
sys.stdin.read()
"""


def older_client_stores_across_a_drop(server: TiersServer, started: list[subprocess.Popen[str]]) -> None:
    """An older client's store whose connection drops before its copy is stored (its
    commit, over the new connection, taken), as another client reads."""
    writer = start(OLDER_CLIENT_DROPPED, server.endpoint, os.path.dirname(__file__))
    started.append(writer)
    says(writer, "1")
    with Client(server.endpoint) as reader:
        key = ObjectKey("kernel-pid", 0, b"older000")
        assert reader.lookup([key]) == 1
        with reader.retrieve([key]) as views:
            assert bytes(views[0]) == bytes([0x5A]) * CHUNK


def test_an_older_clients_commit_after_a_drop_is_tied_to_its_store_by_the_kernel(
    server: TiersServer, processes: list[subprocess.Popen[str]]
) -> None:
    """Its new connection carries no HELLO pid, but the kernel names the same process at
    both connections: the commit commits the reservation made under the old identity,
    which used to be refused (reservation_lost) and stay fenced while the process lived."""
    older_client_stores_across_a_drop(server, processes)
    sessions = server.frontends[0].handlers.sessions
    assert not any(session.writes or session.fenced for session in sessions)
