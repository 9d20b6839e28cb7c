"""A client stalled in the middle of a shared-memory store never writes into another object.

The client checks its reservations' generations, then copies.  Stalled between the two for
longer than the write TTL and the lease grace, its copy used to land in whatever object the
server had put in the reaped extent since: that object's readers got the stalled client's
bytes.  The extent is now fenced until the client commits or aborts the key.  L1's clock is
driven through ``expire_locks(now)`` from inside the client's copy: no sleeps.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from lmcache_plugin_frontend_native import writers
from native_fence_support import (
    CHUNK,
    SHORT_TTL,
    CuttableLink,
    drop_before_copy,
    outlive_write_ttl,
    read,
    stall_before_copy,
)
from native_keys import keys_of, leases_of, stats_of
from native_stop import wait_for

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p


def test_a_copy_after_the_reservation_expired_never_lands_in_another_object(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    stalled_key, victim_key = keys_of(2)
    with Client(server.endpoint) as writer, Client(server.endpoint) as other:

        def stall() -> None:
            outlive_write_ttl(server)
            # Another client stores meanwhile: the extent it gets must not be the stalled one's.
            assert other.store([victim_key], [bytes([0x11]) * CHUNK]) == 1

        stall_before_copy(writer, monkeypatch, stall)
        # Its reservation was reaped: nothing stored, and the late copy went nowhere shared.
        assert writer.store([stalled_key], [bytes([0xEE]) * CHUNK]) == 0
        monkeypatch.undo()

        assert read(other, victim_key) == bytes([0x11]) * CHUNK
        assert stats_of(server).store_keys_refused["reservation_lost"] == 1
        # The commit said the copy was over: the fenced extent went back.
        held = leases_of(server)
        assert held["quarantined_fenced"] == held["reclaimed_writer_done"] == 1
        assert held["fenced_extents"] == held["fenced_bytes"] == 0
        # and the client stores the key again as usual
        assert writer.store([stalled_key], [bytes([0xEE]) * CHUNK]) == 1
        assert read(other, stalled_key) == bytes([0xEE]) * CHUNK


def test_a_client_that_never_says_its_copy_ended_keeps_its_extent_out_of_reach(server: TiersServer) -> None:
    stalled_key, victim_key = keys_of(2)
    with Client(server.endpoint) as writer, Client(server.endpoint) as other:
        reply = writer._call(p.StoreReserve(0, "", [stalled_key], [CHUNK]), p.StoreReserveReply)
        (slot,) = reply.slots
        outlive_write_ttl(server)
        server.storage.l1.expire_locks(time.monotonic() + 10 * server.storage.l1.write_ttl_s)
        assert other.store([victim_key], [bytes([0x11]) * CHUNK]) == 1
        assert leases_of(server)["fenced_extents"] == 1
        victim = server.storage.l1.get(victim_key)
        assert victim is not None and victim.offset != slot.offset
        # Its abort is the word that the copy is over.
        assert writer._call(p.StoreAbort(0, "", [stalled_key]), p.StoreReply).done == [True]
        assert leases_of(server)["fenced_extents"] == 0


def fenced_by_its_session(server: TiersServer) -> bool:
    """L1 fenced the reservation, and the front end's sweep put it with its client's."""
    sessions = server.frontends[0].handlers.sessions
    return leases_of(server)["fenced_extents"] == 1 and any(session.fenced for session in sessions)


def test_a_client_is_refused_new_stores_past_its_fenced_bound(make_server: Any) -> None:
    server = make_server(**SHORT_TTL)
    server.frontends[0].handlers.fenced_bytes_per_client = CHUNK  # one fenced chunk reaches it
    stalled_key, next_key = keys_of(2)
    with Client(server.endpoint) as writer:
        writer._call(p.StoreReserve(0, "", [stalled_key], [CHUNK]), p.StoreReserveReply)
        wait_for(lambda: fenced_by_its_session(server), "the expired reservation fenced")
        with pytest.raises(ServerError) as refused:
            writer.store([next_key], [bytes(CHUNK)])
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
        assert stats_of(server).store_keys_refused["out_of_memory"] == 1
        # once it aborts the expired reservation, it stores again
        assert writer._call(p.StoreAbort(0, "", [stalled_key]), p.StoreReply).done == [False]
        assert leases_of(server)["fenced_extents"] == 0
        assert writer.store([next_key], [bytes(CHUNK)]) == 1


def test_a_key_whose_expired_reservation_is_outstanding_is_not_reserved_again_for_its_client(
    make_server: Any,
) -> None:
    server = make_server(**SHORT_TTL)
    (key,) = keys_of(1)
    with Client(server.endpoint) as writer, Client(server.endpoint) as other:
        writer._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
        wait_for(lambda: fenced_by_its_session(server), "the expired reservation fenced")
        # A second reservation of the key would make its commit ambiguous: which copy ended?
        with pytest.raises(ServerError) as refused:
            writer.store([key], [bytes(CHUNK)])
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
        # Other clients are not held up by it.
        assert other.store([key], [bytes(CHUNK)]) == 1


_RESERVE_AND_WAIT = """
import sys
from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p
client = Client(sys.argv[1])
key = ObjectKey("write-fence", 0, b"exited00")
reply = client._call(p.StoreReserve(0, "", [key], [int(sys.argv[2])]), p.StoreReserveReply)
print(reply.slots[0].offset, flush=True)
sys.stdin.read()  # stalled mid-store until killed
"""


def test_the_fence_of_a_client_whose_process_exited_is_lifted(make_server: Any) -> None:
    server = make_server(**SHORT_TTL)
    writer = subprocess.Popen(
        [sys.executable, "-c", _RESERVE_AND_WAIT, server.endpoint, str(CHUNK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert int(writer.stdout.readline()) >= 0
        wait_for(lambda: leases_of(server)["fenced_extents"] == 1, "the expired reservation fenced")
        # Alive, it keeps the fence whatever the time (no commit, no abort, no exit).
        server.storage.l1.expire_locks(time.monotonic() + 3600.0)
        assert leases_of(server)["fenced_extents"] == 1
    finally:
        writer.kill()
        writer.wait()
    wait_for(lambda: leases_of(server)["fenced_extents"] == 0, "the fence of the exited client lifted")
    assert leases_of(server)["reclaimed_writer_done"] == 1


def reserve_and_outlive(server: TiersServer, writer: Client, key: ObjectKey) -> None:
    writer._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
    wait_for(lambda: fenced_by_its_session(server), "the expired reservation fenced")


def test_a_client_back_under_a_new_identity_lifts_the_fence_of_its_earlier_one(make_server: Any) -> None:
    """A dropped connection comes back under a new ZeroMQ identity, and the store's commit
    or abort goes over it: the fence of the reservation made under the old identity is
    lifted by it, or a long-lived process would strand a batch fenced at every drop."""
    server = make_server(**SHORT_TTL)
    aborted, committed = keys_of(2)
    with Client(server.endpoint) as before_the_drop, Client(server.endpoint) as after_the_drop:
        reserve_and_outlive(server, before_the_drop, aborted)
        assert after_the_drop._call(p.StoreAbort(0, "", [aborted]), p.StoreReply).done == [False]
        assert leases_of(server)["fenced_extents"] == 0
        reserve_and_outlive(server, before_the_drop, committed)
        assert after_the_drop._call(p.StoreCommit(0, "", [committed]), p.StoreReply).done == [False]
        held = leases_of(server)
        assert held["fenced_extents"] == 0
        assert held["quarantined_fenced"] == held["reclaimed_writer_done"] == 2


def test_a_live_reservation_of_an_earlier_identity_is_committed_by_the_client_back(
    server: TiersServer,
) -> None:
    (key,) = keys_of(1)
    with Client(server.endpoint) as before_the_drop, Client(server.endpoint) as after_the_drop:
        before_the_drop._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
        assert after_the_drop._call(p.StoreCommit(0, "", [key]), p.StoreReply).done == [True]
        assert server.storage.l1.get(key) is not None
        # nothing left behind to expire and be fenced
        assert not any(session.writes for session in server.frontends[0].handlers.sessions)


def pidfds_open() -> int:
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile by another thread
            found += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    return found


def test_telling_a_client_back_from_its_earlier_identity_leaves_no_pidfd_open(server: TiersServer) -> None:
    """Here the kernel cannot name the client (it runs in the server's own process), so
    its HELLO pid is watched to tie it to its earlier identity; that watch, of a client
    that holds nothing, used to stay open for good, one more at every such commit."""
    before = pidfds_open()
    for key in keys_of(3):
        with Client(server.endpoint) as before_the_drop, Client(server.endpoint) as after_the_drop:
            before_the_drop._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
            assert after_the_drop._call(p.StoreCommit(0, "", [key]), p.StoreReply).done == [True]
    assert pidfds_open() <= before


def test_a_client_storing_the_key_itself_leaves_the_fence_of_another_in_place(make_server: Any) -> None:
    server = make_server(**SHORT_TTL)
    (key,) = keys_of(1)
    with Client(server.endpoint) as stalled, Client(server.endpoint) as other:
        reserve_and_outlive(server, stalled, key)
        assert other.store([key], [bytes(CHUNK)]) == 1
        assert leases_of(server)["fenced_extents"] == 1


def test_the_pid_of_a_client_holding_reservations_outlasts_later_hellos(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The HELLO pids kept are bounded; a long-lived client's HELLO is the oldest, and
    without its pid the fence of its reservations would outlive its process."""
    monkeypatch.setattr(writers, "MAX_PIDS", 2)
    (key,) = keys_of(1)
    handlers = server.frontends[0].handlers
    with Client(server.endpoint) as long_lived:
        long_lived._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
        (identity,) = [session.identity for session in handlers.sessions if session.writes]
        for _ in range(3):
            with Client(server.endpoint):
                pass
        assert handlers.writers._pids.get(identity) == os.getpid()


def test_a_store_whose_connection_dropped_mid_copy_is_committed_not_fenced(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop comes between the client's check of its slots and its copy: its commit
    goes over the new connection, under a new identity, and still commits the
    reservation made under the old one, which would otherwise expire and stay fenced for
    as long as the client's process lives."""
    (key,) = keys_of(1)
    link = CuttableLink(server.endpoint)
    try:
        with Client(link.url) as writer, Client(server.endpoint) as reader:
            drop_before_copy(writer, link, monkeypatch)
            assert writer.store([key], [bytes([0x5A]) * CHUNK]) == 1
            monkeypatch.undo()
            assert read(reader, key) == bytes([0x5A]) * CHUNK
            sessions = server.frontends[0].handlers.sessions
            assert not any(session.writes or session.fenced for session in sessions)
    finally:
        link.close()
