"""What docs/upgrading.md says of native clients older than 45bf14bd: those send no HELLO
before the commit or abort of a store whose connection dropped mid-copy.  The server ties
the new connection (a new ZeroMQ identity) to the reservations of the old one by the
process the kernel names at both (test_writer_kernel_pid.py); where it cannot tell -- here
the relay runs in the server's own process -- only by the pid a HELLO reports, so such a
commit is refused and the reservation, once expired, stays fenced while the client's
process lives (test_write_fence.py shows its exit lifting it).
"""

from __future__ import annotations

import time

import pytest
from native_fence_support import CHUNK, CuttableLink, drop_before_copy, outlive_write_ttl, read
from native_keys import keys_of, leases_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer


def test_an_older_clients_store_dropped_mid_copy_stays_fenced_while_it_lives(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    (key,) = keys_of(1)
    link = CuttableLink(server.endpoint)
    try:
        with Client(link.url) as writer, Client(server.endpoint) as reader:
            # The client before 45bf14bd: nothing between its copy and its commit.
            monkeypatch.setattr(writer, "_greet_again_if_dropped", lambda: None)
            drop_before_copy(writer, link, monkeypatch)
            assert writer.store([key], [bytes([0x5A]) * CHUNK]) == 0
            monkeypatch.undo()
            assert stats_of(server).store_keys_refused["reservation_lost"] == 1
            outlive_write_ttl(server)
            server.storage.l1.expire_locks(time.monotonic() + 3600.0)
            assert leases_of(server)["fenced_extents"] == 1
            # Its later requests greet the server from this process again; the fence of
            # the store made under the identity before the drop stays all the same.
            other_key = keys_of(2)[1]
            assert writer.store([other_key], [bytes([0x11]) * CHUNK]) == 1
            assert read(reader, other_key) == bytes([0x11]) * CHUNK
            server.storage.l1.expire_locks(time.monotonic() + 7200.0)
            assert leases_of(server)["fenced_extents"] == 1
    finally:
        link.close()
