"""Each key a STORE names is counted once: newly stored (``store_chunks``), skipped or
refused, under the reason it was -- what ``store_keys_skipped_total`` and
``store_keys_refused_total`` export."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import zmq
from native_keys import keys_of, stats_of

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p


def reserve(client: Client, keys: list[ObjectKey]) -> list[bool]:
    """Which of ``keys`` the STORE_RESERVE gave a slot."""
    reply = client._call(p.StoreReserve(0, "", keys, [4096] * len(keys)), p.StoreReserveReply)
    return [slot.offset != p.NO_SLOT for slot in reply.slots]


def test_each_key_a_store_names_is_counted_once_under_its_outcome(server: TiersServer) -> None:
    k = keys_of(4)
    with Client(server.endpoint) as writer, Client(server.endpoint) as other:
        assert reserve(writer, [k[0]]) == [True]  # held while the other client stores
        # k0 another writer's, k1 new, k1 again
        assert reserve(other, [k[0], k[1], k[1]]) == [False, True, False]
        assert other._call(p.StoreCommit(0, "", [k[1]]), p.StoreReply).done == [True]
        assert reserve(other, [k[1], k[2]]) == [False, True]  # k1 stored already
        assert other._call(p.StoreAbort(0, "", [k[2]]), p.StoreReply).done == [True]
        # a commit naming its key twice stores it once; the repeat lost nothing
        assert writer._call(p.StoreCommit(0, "", [k[0], k[0]]), p.StoreReply).done == [True, False]
        try:  # two keys, one size: refused whole
            other._call(p.StoreReserve(0, "", [k[3], k[3]], [4096]), p.StoreReserveReply)
        except ServerError as refused:
            assert refused.code is p.ErrorCode.INVALID_ARGUMENT
        else:
            raise AssertionError("a STORE_RESERVE with fewer sizes than keys was served")

    stats = stats_of(server)
    assert stats.store_chunks == 2  # k1, k0
    skipped = {reason: count for reason, count in stats.store_keys_skipped.items() if count}
    assert skipped == {"being_written": 1, "repeated": 1, "present": 1, "aborted": 1}
    refused = {reason: count for reason, count in stats.store_keys_refused.items() if count}
    assert refused == {"invalid_argument": 2}
    # 1 + 3 + 2 keys reserved, 2 refused: every one counted once
    assert stats.store_chunks + sum(skipped.values()) + sum(refused.values()) == 8


def test_a_refused_store_counts_its_keys_whichever_step_refused_it(
    make_server: Callable[..., TiersServer],
) -> None:
    # The keys a refusal leaves unstored are worked out only when a request is refused:
    # before dispatch (the token), in dispatch, and in the pool (a STORE_INLINE L1 has no
    # room for); requests that store nothing are refused without counting any.
    server = make_server(server_options={"auth_token": "secret"})
    k = keys_of(3)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        for request in (p.StoreReserve(0, "wrong", k[:2], [4096] * 2), p.Lookup(0, "wrong", k)):
            sock.send(p.encode(request))
            assert sock.poll(10_000), "no reply"
            reply = p.reply_decoder.decode(sock.recv())
            assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.UNAUTHORIZED.value
    finally:
        sock.close(0)
    with Client(server.endpoint, auth_token="secret", shm=False) as writer:
        with pytest.raises(ServerError) as refused:  # more than all of L1, refused in the pool
            writer.store(k, [bytes(40 << 20)] * 3, l1_only=True)
        assert refused.value.code is p.ErrorCode.OUT_OF_MEMORY
    refused_keys = {reason: count for reason, count in stats_of(server).store_keys_refused.items() if count}
    assert refused_keys == {"unauthorized": 2, "out_of_memory": 3}
