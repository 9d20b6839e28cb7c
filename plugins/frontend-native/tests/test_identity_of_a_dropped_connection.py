"""A routing identity is the peer's choice: a connection naming the identity of one that
dropped holding reservations cannot commit or abort them, nor reserve under it; only a
commit over the connection that reserved makes its extent readable."""

from __future__ import annotations

import time

import zmq
from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p


def exchange(sock: zmq.Socket[bytes], request: p._Request) -> p.Reply:
    sock.send(p.encode(request))
    assert sock.poll(10_000), "no reply"
    return p.reply_decoder.decode(sock.recv_multipart()[0])


def take_over(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, identity: bytes, request: p._Request
) -> tuple[zmq.Socket[bytes], p.Reply]:
    """A connection under ``identity`` and its reply to ``request``: the server refuses
    the identity while it still holds the connection that dropped, so until it has seen the
    drop each try goes unanswered."""
    deadline = time.monotonic() + 30
    while True:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(endpoint)
        sock.send(p.encode(request))
        if sock.poll(500):
            return sock, p.reply_decoder.decode(sock.recv_multipart()[0])
        sock.close(0)
        assert time.monotonic() < deadline, "the server never took the identity of the dropped connection"


def test_a_connection_taking_over_a_dropped_identity_cannot_commit_what_it_reserved(
    server: TiersServer,
) -> None:
    keys = keys_of(1)
    context = zmq.Context()
    owner = context.socket(zmq.DEALER)
    owner.setsockopt(zmq.LINGER, 0)
    owner.connect(server.endpoint)
    try:
        reply = exchange(owner, p.StoreReserve(1, "", keys, [4096]))
        assert isinstance(reply, p.StoreReserveReply) and reply.slots[0].offset >= 0
        (identity,) = [session.identity for session in server.frontends[0].handlers.sessions]  # type: ignore[attr-defined]
        owner.close(0)  # dropped before its copy: the extent holds no bytes of the key
        with Client(server.endpoint) as reader:
            intruder, commit = take_over(context, server.endpoint, identity, p.StoreCommit(2, "", keys))
            try:
                assert isinstance(commit, p.StoreReply) and commit.done == [False]
                abort = exchange(intruder, p.StoreAbort(3, "", keys))
                assert isinstance(abort, p.StoreReply) and abort.done == [False]
                refused = exchange(intruder, p.StoreReserve(4, "", keys_of(1), [4096]))
                assert refused.code == p.ErrorCode.INVALID_ARGUMENT
            finally:
                intruder.close(0)
            assert reader.lookup(keys) == 0
    finally:
        context.term()
