"""A HELLO pid no process can have is refused, rather than breaking the client's stores.

The pid a HELLO reports is kept for the connection: its first STORE_RESERVE pins the
process it names with a pidfd, and the fences of the client's reservations may wait for
that process.  A pid past what ``pid_t`` holds made ``pidfd_open`` raise OverflowError (no
OSError, so not taken as "no such process"): the STORE_RESERVE failed as INTERNAL after L1
had reserved and fenced its extents, which no session held -- once the write TTL passed they
stayed fenced until the server stopped, every such store leaking more of L1.
"""

from __future__ import annotations

import pytest
from native_fence_support import outlive_write_ttl
from native_keys import keys_of, leases_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.client.errors import ServerError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p


@pytest.mark.parametrize("pid", [1 << 31, 1 << 62, -1])
def test_a_hello_pid_no_process_can_have_is_refused(server: TiersServer, pid: int) -> None:
    with Client(server.endpoint, timeout=30) as client:
        assert client.uses_shm
        with pytest.raises(ServerError) as refused, client._lock:
            client._call(p.Hello(0, "", p.PROTOCOL_VERSION, "bad-pid", pid), p.HelloReply)
        assert refused.value.code is p.ErrorCode.INVALID_ARGUMENT
        assert f"pid {pid}" in str(refused.value)
        # The connection's stores go on as before, under the pid its first HELLO told.
        keys = keys_of(2)
        with client._lock:
            reply = client._call(p.StoreReserve(0, "", keys, [256, 256]), p.StoreReserveReply)
            assert [slot.offset != p.NO_SLOT for slot in reply.slots] == [True, True]
            assert client._call(p.StoreAbort(0, "", keys), p.StoreReply).done == [True, True]
        assert stats_of(server).failures.get("internal", 0) == 0
        outlive_write_ttl(server)
        assert leases_of(server)["fenced_extents"] == 0
        assert server.storage.l1.stats().objects == 0
