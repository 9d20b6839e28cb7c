"""The RPC loop's answers to bad, refused and late requests, seen from a raw DEALER."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from lmcache_tiers.client import Client, ClientError, RequestTimeoutError, ServerError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]
KEY = ObjectKey("unit", 0, b"k" * 16)


@pytest.fixture
def raw(server: TiersServer) -> Iterator[Callable[..., p.Reply]]:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)

    def exchange(*frames: bytes) -> p.Reply:
        sock.send_multipart(list(frames))
        assert sock.poll(10_000), "no reply"
        return p.reply_decoder.decode(sock.recv_multipart()[0])

    yield exchange
    sock.close(0)
    context.term()


def test_version_mismatch_is_refused_at_hello(raw: Callable[..., p.Reply]) -> None:
    reply = raw(p.encode(p.Hello(3, "", p.PROTOCOL_VERSION + 1)))
    assert (reply.req_id, reply.code) == (3, p.ErrorCode.VERSION_MISMATCH)
    assert "version" in reply.message
    hello = raw(p.encode(p.Hello(4, "", p.PROTOCOL_VERSION)))
    assert isinstance(hello, p.HelloReply) and hello.shm_name and hello.shm_size > 0


def test_shapes_that_cannot_be_served(raw: Callable[..., p.Reply]) -> None:
    assert raw(b"\x93\x02").code == p.ErrorCode.MALFORMED  # truncated array
    assert raw(msgspec.msgpack.encode([200, 6, ""])).code == p.ErrorCode.UNKNOWN_OP
    reply = raw(p.encode(p.Ping(8, "")), b"stray payload")
    assert (reply.req_id, reply.code) == (8, p.ErrorCode.INVALID_ARGUMENT)
    reply = raw(p.encode(p.StoreInline(9, "", [KEY, KEY])), b"only one")
    assert (reply.req_id, reply.code) == (9, p.ErrorCode.INVALID_ARGUMENT)
    reply = raw(p.encode(p.StoreInline(10, "", [KEY])), b"")
    assert (reply.req_id, reply.code) == (10, p.ErrorCode.INVALID_ARGUMENT)
    reply = raw(p.encode(p.StoreReserve(11, "", [KEY], [1, 2])))
    assert (reply.req_id, reply.code) == (11, p.ErrorCode.INVALID_ARGUMENT)
    assert isinstance(raw(p.encode(p.Ping(12, ""))), p.PingReply)


def test_requests_over_the_size_limit(make_server: Factory) -> None:
    limits = {"max_request_bytes": 64 << 10, "max_inline_bytes": 32 << 10}
    server = make_server(frontends=[{"type": "native", **limits}])
    with Client(server.endpoint, shm=False) as client:
        with pytest.raises(ServerError) as refused:
            client._call(p.StoreInline(0, "", [KEY]), p.StoreReply, payloads=[bytes(100 << 10)])
        assert refused.value.code is p.ErrorCode.TOO_LARGE
        assert client.ping() > 0
    assert server.frontends[0].stats().failures["too_large"] == 1


def test_every_request_is_checked_against_the_token(make_server: Factory) -> None:
    server = make_server(server_options={"auth_token": "correct horse"})
    with pytest.raises(ServerError) as refused:
        Client(server.endpoint, auth_token="wrong")
    assert refused.value.code is p.ErrorCode.UNAUTHORIZED
    with Client(server.endpoint, auth_token="correct horse") as client:
        assert client.store([KEY], [b"x" * 100]) == 1
        client._token = ""  # a later request without it is refused too
        with pytest.raises(ServerError) as later:
            client.lookup([KEY])
        assert later.value.code is p.ErrorCode.UNAUTHORIZED


def test_stopping_server_finishes_in_flight_work_and_refuses_new(make_server: Factory) -> None:
    server = make_server()
    entered, release = threading.Event(), threading.Event()
    real_clear = server.storage.clear

    def slow_clear(*, force: bool = False) -> int:
        entered.set()
        release.wait(10)
        return real_clear(force=force)

    server.storage.clear = slow_clear  # type: ignore[method-assign]
    with Client(server.endpoint) as waiting, Client(server.endpoint) as late:
        result: list[int] = []
        clearing = threading.Thread(target=lambda: result.append(waiting.clear()))
        clearing.start()
        assert entered.wait(10)
        server.request_stop()
        with pytest.raises(ServerError) as refused:
            for _ in range(100):
                late.ping()  # answered until the loop notices the stop, then refused
        assert refused.value.code is p.ErrorCode.SHUTTING_DOWN
        release.set()
        # longer than the client's own 10 s timeout: the thread always ends before its
        # client is closed (closing a ZeroMQ socket another thread receives on aborts)
        clearing.join(30)
        assert not clearing.is_alive()
    assert result == [0], "the in-flight CLEAR was not answered before the server stopped"


def test_unknown_handles_are_not_found(server: TiersServer) -> None:
    with Client(server.endpoint) as client:
        for call in (lambda: client.query_prefetch(12345), lambda: client.wait_prefetch(12345, 0.1)):
            with pytest.raises(ServerError) as missing:
                call()
            assert missing.value.code is p.ErrorCode.NOT_FOUND
        # a handle belongs to the client that started it
        handle, hits = client.start_lookup([KEY])
        assert hits == 0
        with Client(server.endpoint) as other, pytest.raises(ServerError):
            other.query_prefetch(handle)


def test_an_oversized_header_is_refused_under_its_own_request_id(raw: Callable[..., p.Reply]) -> None:
    header = msgspec.msgpack.encode([p.Op.LOOKUP, 4242, "", "x" * (p.MAX_HEADER_BYTES + 1)])
    reply = raw(header)
    assert (reply.req_id, reply.code) == (4242, p.ErrorCode.TOO_LARGE)
    assert "limit" in reply.message


def test_the_client_refuses_to_send_an_oversized_header(server: TiersServer) -> None:
    model = "m" * 256
    keys = [
        ObjectKey(model, 0, index.to_bytes(64, "big"), 0, "s" * 128)
        for index in range(p.MAX_KEYS_PER_REQUEST + 2000)
    ]
    with Client(server.endpoint, timeout=5) as client:
        with pytest.raises(ClientError, match="header limit") as refused:
            client._call(p.Lookup(0, "", keys), p.LookupReply)
        assert not isinstance(refused.value, RequestTimeoutError)
        assert client.ping() > 0  # nothing is left waiting


def test_a_key_list_sent_again_goes_out_as_the_bytes_encoding_it_gives(server: TiersServer) -> None:
    """The client keeps the msgpack of the last key list it sent: every header is still
    byte for byte what encoding the request gives, also once the list changed in place."""
    keys = [ObjectKey("unit", 0, bytes([index]) * 16) for index in range(20)]
    with Client(server.endpoint, timeout=5) as client:
        requests = [p.Lookup(0, "", keys), p.Lookup(0, "", keys, 1.5), p.Release(0, "", keys)]
        requests += [p.Retrieve(0, "", list(keys), True), p.Lookup(0, "", keys[:3]), p.Ping(0, "")]
        for request in requests + requests:
            assert client._header(request) == p.encode(request)
        keys.reverse()
        request = p.Lookup(0, "", keys)
        assert client._header(request) == p.encode(request)
        client.store(keys[:4], [b"x" * 64] * 4)
        assert [client.lookup(keys) for _ in range(3)] == [4, 4, 4]
        keys[2] = KEY  # not stored
        assert client.lookup(keys) == 2
        client.release(keys[:4])


def test_asking_about_what_one_does_not_hold_costs_no_session(server: TiersServer) -> None:
    # Each peer picks its identity; only taking a lock, a reservation or a prefetch may make
    # the server remember one.
    context = zmq.Context()
    try:
        for index, request in enumerate(
            [
                p.QueryPrefetchStatus(1, "", 7),
                p.WaitPrefetchStatus(2, "", 7, 0.0),
                p.StoreCommit(3, "", [KEY]),
                p.StoreAbort(4, "", [KEY]),
                p.Release(5, "", [KEY]),
            ]
        ):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, b"peer-%d" % index)
            sock.connect(server.endpoint)
            sock.send(p.encode(request))
            assert sock.poll(10_000), "no reply"
            reply = p.reply_decoder.decode(sock.recv_multipart()[0])
            assert reply.req_id == request.req_id
            sock.close(0)
    finally:
        context.term()
    assert len(server.frontends[0].handlers.sessions) == 0


def test_a_status_value_msgpack_lacks_neither_kills_the_loop_nor_goes_unanswered(server: TiersServer) -> None:
    from pathlib import Path

    import numpy as np

    # A component's stat of a type msgpack has no encoding for (a numpy integer, a path):
    # HTTP /status writes it as a string, and so does the native STATUS.
    handlers = server.frontends[0].handlers
    document = handlers.status_provider
    handlers.status_provider = lambda: {**document(), "odd": {"count": np.int64(3), "dir": Path("/x")}}
    ping = handlers._table[p.Ping]
    with Client(server.endpoint, timeout=5) as client:
        assert client.status()["odd"] == {"count": "3", "dir": "/x"}
        assert client.ping() > 0
        # a reply that cannot be encoded at all is refused as an internal error, not dropped
        unencodable = {"x": object()}
        handlers._table[p.Ping] = lambda req, identity, frames: (p.StatusReply(req.req_id, unencodable), ())
        try:
            with pytest.raises(ServerError) as refused:
                client.ping()
        finally:
            handlers._table[p.Ping] = ping
        assert refused.value.code is p.ErrorCode.INTERNAL
        assert client.ping() > 0
    assert server.frontends[0].health() == (True, "ok")
    assert server.frontends[0].stats().failures["internal"] == 1


def test_every_refusal_is_explained_in_the_log(
    raw: Callable[..., p.Reply], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_plugin_frontend_native"):
        assert raw(b"\x93\x02").code == p.ErrorCode.MALFORMED
        assert raw(msgspec.msgpack.encode([200, 6, ""])).code == p.ErrorCode.UNKNOWN_OP
        assert raw(p.encode(p.Ping(8, "")), b"stray payload").code == p.ErrorCode.INVALID_ARGUMENT
        assert raw(b"\x93\x02").code == p.ErrorCode.MALFORMED  # the same kind again: counted only
    refusals = [record.getMessage() for record in caplog.records if "refused request" in record.getMessage()]
    assert len(refusals) == 3, refusals
    assert [
        code for code in ("MALFORMED", "UNKNOWN_OP", "INVALID_ARGUMENT") if any(code in r for r in refusals)
    ] == [
        "MALFORMED",
        "UNKNOWN_OP",
        "INVALID_ARGUMENT",
    ]
