"""A key reserved again by the client whose earlier reservation of it L1 reaped first.

The session's deadline of a reservation is read a moment before L1 takes it, so L1 may
reap a reservation its client's session still holds live: a STORE_RESERVE of the key
then finds it free in L1 and reserves it anew.  The session used to put the new
reservation in the old one's place and forget the old one, whose extent L1 had fenced
(its writer may still be copying into it): nothing ever gave that extent back, nor
counted it against the client's bound.  L1's clock is driven through ``expire_locks(now)``.
"""

from __future__ import annotations

import time

import pytest
from native_fence_support import CHUNK, read
from native_keys import keys_of, leases_of, stats_of

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p


def reap_in_l1_only(server: TiersServer) -> None:
    """L1 reaps the write reservations (fencing them) before the front end's sweep sees
    them expire."""
    l1 = server.storage.l1
    l1.expire_locks(time.monotonic() + l1.write_ttl_s + 1)


def test_a_reservation_l1_reaped_is_not_forgotten_when_its_key_is_reserved_again(server: TiersServer) -> None:
    key, other_key = keys_of(2)
    with Client(server.endpoint) as writer, Client(server.endpoint) as reader:
        writer._call(p.StoreReserve(0, "", [key], [CHUNK]), p.StoreReserveReply)
        reap_in_l1_only(server)
        assert leases_of(server)["fenced_extents"] == 1
        # Not reserved again while the earlier one may still be copied into: which copy
        # would its commit say ended?
        with pytest.raises(ServerError) as refused:
            writer._call(p.StoreReserve(0, "", [key, other_key], [CHUNK, CHUNK]), p.StoreReserveReply)
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
        stats = stats_of(server)
        assert stats.store_keys_refused["out_of_memory"] == 2
        assert stats.failures["store_reservation_expired"] == 1
        assert reader.lookup([other_key]) == 0  # nothing of the refused request stays reserved
        # Its abort says the copy is over: the fenced extent goes back.
        writer._call(p.StoreAbort(0, "", [key]), p.StoreReply)
        held = leases_of(server)
        assert held["fenced_extents"] == held["fenced_bytes"] == 0
        assert held["reclaimed_writer_done"] == 1
        # and the client stores the key as usual
        assert writer.store([key], [bytes([0x5A]) * CHUNK]) == 1
        assert read(reader, key) == bytes([0x5A]) * CHUNK
