"""LOOKUP with ``wait_s`` (feature ``lookup_wait``): one round trip when the prefix is in L2,
and old clients and old servers keep working both ways."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import msgspec
import pytest
import zmq
from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]
#: an L2 whose lookups and loads each take 0.3 s; its stores (the flush that puts the keys
#: there) are not slowed
SLOW_MOCK = json.dumps(
    {
        "type": "fault_inject",
        "inner": {"type": "mock", "max_size_gb": 0.1},
        "delay_s": 0.3,
        "delay_ops": ["lookup", "load"],
    }
)


def requests_of(server: TiersServer) -> Counter[str]:
    return Counter(server.frontend_stats()[0][1].requests)


def only_in_l2(server: TiersServer, client: Client, count: int) -> tuple[list[ObjectKey], list[bytes]]:
    keys, data = keys_of(count), [os.urandom(5000) for _ in range(count)]
    assert client.store(keys, data) == count
    assert server.storage.flush(timeout=30)
    assert client.clear() == count
    return keys, data


class RawPeer(NamedTuple):
    """A server with a slow L2, keys only in that L2, and a DEALER without the client's help."""

    server: TiersServer
    keys: list[ObjectKey]
    exchange: Callable[[bytes], p.Reply]


@pytest.fixture
def raw(make_server: Factory) -> Iterator[RawPeer]:
    server = make_server(adapters=[SLOW_MOCK])
    with Client(server.endpoint) as client:
        keys, _ = only_in_l2(server, client, 2)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)

    def exchange(header: bytes) -> p.Reply:
        sock.send(header)
        assert sock.poll(30_000), "no reply"
        return p.reply_decoder.decode(sock.recv_multipart()[0])

    yield RawPeer(server, keys, exchange)
    sock.close(0)
    context.term()


def test_a_lookup_from_l2_is_one_round_trip(make_server: Factory) -> None:
    server = make_server(adapters=[SLOW_MOCK])
    with Client(server.endpoint) as client:
        assert "lookup_wait" in client.server_features
        keys, data = only_in_l2(server, client, 4)
        before = requests_of(server)
        assert client.lookup(keys, timeout=30) == 4
        sent = requests_of(server) - before
        assert sent == Counter({"Lookup": 1}), sent
        assert server.storage.status()["requests"]["l2_hit_chunks"] == 4
        with client.retrieve(keys) as views:  # the locks the prefetch took are the client's
            assert [bytes(view) for view in views] == data
        assert server.storage.status()["l1"]["read_locks"] == 0


def test_a_client_of_an_older_server_looks_up_then_waits(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(adapters=[SLOW_MOCK])
    monkeypatch.setattr(p, "FEATURES", ("l1_only_store", "evict"))  # what older servers announce
    with Client(server.endpoint) as client:
        assert "lookup_wait" not in client.server_features
        keys, _ = only_in_l2(server, client, 3)
        before = requests_of(server)
        assert client.lookup(keys, timeout=30) == 3
        assert requests_of(server) - before == Counter({"Lookup": 1, "WaitPrefetchStatus": 1})
        assert client.release(keys) == 3


def test_a_wait_that_runs_out_leaves_the_handle_to_ask_about(raw: RawPeer) -> None:
    reply = raw.exchange(p.encode(p.Lookup(7, "", raw.keys, 0.01)))
    assert isinstance(reply, p.LookupReply) and reply.req_id == 7
    assert reply.hits is None and reply.handle > 0
    waited = raw.exchange(p.encode(p.WaitPrefetchStatus(8, "", reply.handle, 30.0)))
    assert isinstance(waited, p.PrefetchStatusReply) and waited.hits == 2
    assert isinstance(raw.exchange(p.encode(p.Release(9, "", raw.keys))), p.ReleaseReply)
    assert raw.server.storage.status()["l1"]["read_locks"] == 0


def test_a_wait_long_enough_answers_with_the_hits(raw: RawPeer) -> None:
    reply = raw.exchange(p.encode(p.Lookup(3, "", raw.keys, 30.0)))
    assert isinstance(reply, p.LookupReply) and reply.hits == 2
    gone = raw.exchange(p.encode(p.QueryPrefetchStatus(4, "", reply.handle)))
    assert gone.code == p.ErrorCode.NOT_FOUND  # collected by the LOOKUP itself
    released = raw.exchange(p.encode(p.Release(5, "", raw.keys)))
    assert isinstance(released, p.ReleaseReply) and released.released == 2


def test_a_header_from_an_older_client_waits_for_nothing(raw: RawPeer) -> None:
    old_header = msgspec.msgpack.encode([p.Op.LOOKUP.value, 1, "", raw.keys])  # no wait_s field
    reply = raw.exchange(old_header)
    assert isinstance(reply, p.LookupReply) and reply.hits is None
    waited = raw.exchange(p.encode(p.WaitPrefetchStatus(2, "", reply.handle, 30.0)))
    assert isinstance(waited, p.PrefetchStatusReply) and waited.hits == 2
    released = raw.exchange(p.encode(p.Release(3, "", raw.keys)))
    assert isinstance(released, p.ReleaseReply) and released.released == 2


class _LookupBeforeWait(msgspec.Struct, array_like=True, tag=p.Op.LOOKUP.value, tag_field="op"):
    """LOOKUP as servers before ``lookup_wait`` declare it."""

    req_id: int
    token: str
    keys: list[ObjectKey]


def test_an_older_server_decodes_a_lookup_that_asks_to_wait() -> None:
    key = ObjectKey("unit", 0, b"k" * 16)
    old = msgspec.msgpack.decode(p.encode(p.Lookup(5, "", [key], 2.5)), type=_LookupBeforeWait)
    assert (old.req_id, old.keys) == (5, [key])
