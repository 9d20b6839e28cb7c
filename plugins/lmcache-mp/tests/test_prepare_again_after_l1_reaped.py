"""A range prepared again by the connection whose earlier reservation of it L1 reaped first.

A store's deadline in the front end is read a moment before L1 takes its reservation, so
L1 may reap (and fence) a reservation the front end still counts live.  A
``prepare_store`` of the same range by the same request on the same connection then
aborted the earlier reservation -- a no-op on objects L1 no longer holds as reserved --
and forgot it: L1 kept its extent fenced, and no commit, unregister or exit of the
client could give it back any more, nor was it counted against the fenced bound.  L1's
clock is driven through ``expire_locks(now)``.
"""

from __future__ import annotations

import time
from typing import Any

from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

WRITER = Registration(instance_id=1000)
SIZE = WRITER.object_bytes


def leases(server: TiersServer) -> dict[str, int]:
    return dict(server.storage_status()["l1"]["leases"])


def reap_in_l1_only(server: TiersServer) -> None:
    """L1 reaps the write reservations (fencing them) before the front end sees them expire."""
    l1 = server.storage.l1
    l1.expire_locks(time.monotonic() + l1.write_ttl_s + 1)


def test_a_reservation_l1_reaped_is_not_forgotten_when_its_range_is_prepared_again(
    make_mp_server: Any,
) -> None:
    server = make_mp_server()
    stalled = Key(tokens_of(1), "stalled", worker_id=0, end=CHUNK_TOKENS)
    with MPClient(mp_address(server)) as writer:
        shm = writer.register(WRITER)["shm_name"]
        first = writer.call("prepare_store", stalled.encode(), WRITER.instance_id)["context"]["slots"]
        assert len(first) == 1
        reap_in_l1_only(server)
        assert leases(server)["fenced_extents"] == 1
        again = writer.call("prepare_store", stalled.encode(), WRITER.instance_id)["context"]["slots"]
        # The client's commit of the range says its copy is over: the fenced extent goes back.
        writer.call("commit_store", stalled.encode(), WRITER.instance_id, b"")
        held = leases(server)
        assert held["fenced_extents"] == held["fenced_bytes"] == 0
        assert held["reclaimed_writer_done"] == 1
        # Not reserved again while the earlier copy may still be going on (which copy would
        # the commit say ended?): refused as the prepare of a range whose expired
        # reservation is outstanding is, and the earlier one counted as expired.
        assert again == []
        stats = mp_stats(server)
        assert stats.failures["mp_store_refused_fenced"] == 1
        assert stats.store_keys_refused["mp_store_refused_fenced"] == 1
        assert stats.failures["mp_transfer_expired"] == 1
        assert stats.store_keys_refused["reservation_expired"] == 1
        assert stats.store_keys_skipped["repeated"] == 0
        # and the client stores the range as usual
        assert writer.store(stalled, WRITER.instance_id, [b"\x5a" * SIZE], shm)
        read = Key(tokens_of(1), "read", worker_id=0, end=CHUNK_TOKENS)
        assert writer.retrieve(read, WRITER.instance_id, shm) == [b"\x5a" * SIZE]
