"""The fences of a client process that exited are lifted; a live one's stay.

LMCache's protocol carries no pid: the front end asks the kernel for the process of each
connection (``SO_PEERCRED`` over ``ipc://``, the owner of the client's socket over
loopback TCP) and watches it through a pidfd.  A client killed mid-store (an OOM kill, a
restart) used to keep its expired reservations fenced until the server stopped, and
with an eighth of L1 fenced every shared-memory store was refused.  Real client
processes here, killed or stopped by signal; the server's own sweeps expire their
reservations and notice the exits (no timing assertions).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, mp_address, tokens_of, wait_for
from writer_processes import fenced_extents, start_writer, transfers_of

from lmcache_tiers.server.app import TiersServer

OTHER = Registration(instance_id=1001)
SIZE = OTHER.object_bytes
#: a write TTL short enough for the server's own sweep and reap to expire a reservation
SHORT_TTL: dict[str, Any] = {"l1_write_ttl_s": 1.0, "l1_lock_ttl_s": 1.0}


@pytest.fixture(params=["ipc", "tcp"])
def server(request: pytest.FixtureRequest, make_mp_server: Any, tmp_path: Path) -> TiersServer:
    where = {"host": f"ipc://{tmp_path}/mp.sock"} if request.param == "ipc" else {"host": "127.0.0.1"}
    made: TiersServer = make_mp_server(**SHORT_TTL, **where)
    return made


def prepare(client: MPClient, sequence: int) -> list[dict[str, Any]]:
    key = Key(tokens_of(sequence), f"next-{sequence}", worker_id=0, end=CHUNK_TOKENS)
    slots: list[dict[str, Any]] = client.call("prepare_store", key.encode(), OTHER.instance_id)["context"][
        "slots"
    ]
    return slots


def test_a_killed_writers_fence_is_lifted_and_stores_go_on(server: TiersServer, writers: list[Any]) -> None:
    transfers = transfers_of(server)
    transfers.fenced_bytes_bound = SIZE  # one fenced chunk refuses every store
    writer = start_writer(server, 1000, 1, writers)
    wait_for(
        lambda: fenced_extents(server) == 1 and transfers.writes.fenced, "the expired reservation fenced"
    )
    with MPClient(mp_address(server)) as other:
        shm = other.register(OTHER)["shm_name"]
        assert prepare(other, 2) == []  # refused while fenced
        writer.kill()  # SIGKILL before its copy and commit
        writer.wait()
        wait_for(lambda: fenced_extents(server) == 0, "the dead writer's fence lifted")
        assert not transfers.writes.fenced and transfers.writes.fenced_bytes == 0
        held = server.storage_status()["l1"]["leases"]
        assert held["reclaimed_writer_done"] == 1
        assert mp_stats(server).failures["mp_fence_writer_exited"] == 1
        # the extent is L1's again, and stores are served
        assert other.store(
            Key(tokens_of(3), "after", worker_id=0, end=CHUNK_TOKENS),
            OTHER.instance_id,
            [b"\x33" * SIZE],
            shm,
        )
        got = other.retrieve(
            Key(tokens_of(3), "after-read", worker_id=0, end=CHUNK_TOKENS), OTHER.instance_id, shm
        )
        assert got == [b"\x33" * SIZE]


def test_a_stopped_writer_stays_fenced_while_a_killed_ones_fence_lifts(
    server: TiersServer, writers: list[Any]
) -> None:
    transfers = transfers_of(server)
    stalled = start_writer(server, 1000, 1, writers)
    killed = start_writer(server, 1002, 2, writers)
    wait_for(
        lambda: fenced_extents(server) == 2 and len(transfers.writes.fenced) == 2, "both reservations fenced"
    )
    os.kill(stalled.pid, signal.SIGSTOP)  # alive, stalled before its copy
    killed.kill()
    killed.wait()
    # The sweep that lifts the killed writer's fence looked at the stalled one's too.
    wait_for(lambda: fenced_extents(server) == 1, "the killed writer's fence lifted")
    assert len(transfers.writes.fenced) == 1
    assert mp_stats(server).failures["mp_fence_writer_exited"] == 1


def test_a_store_waits_for_its_own_writer_not_an_earlier_process_of_its_identity(
    server: TiersServer, writers: list[Any]
) -> None:
    """A client may pick its routing identity: a process back under the identity of one
    that exited is another writer, whose stalled store stays fenced."""
    transfers = transfers_of(server)
    first = start_writer(server, 1000, 1, writers, routing_id="fixed-worker")
    wait_for(lambda: fenced_extents(server) == 1 and transfers.writes.fenced, "the first reservation fenced")
    first.kill()
    first.wait()
    wait_for(lambda: fenced_extents(server) == 0, "the first writer's fence lifted")
    again = start_writer(server, 1002, 2, writers, routing_id="fixed-worker")
    killed = start_writer(server, 1003, 3, writers)
    wait_for(lambda: fenced_extents(server) == 2, "both reservations fenced")
    os.kill(again.pid, signal.SIGSTOP)
    killed.kill()
    killed.wait()
    wait_for(lambda: fenced_extents(server) == 1, "the killed writer's fence lifted")
    assert mp_stats(server).failures["mp_fence_writer_exited"] == 2
