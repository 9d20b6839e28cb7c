"""RouterLoop's reply plumbing, driven directly over a real ROUTER socket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import RouterLoop


@pytest.fixture
def loop() -> Iterator[RouterLoop]:
    router = RouterLoop(
        "tcp://127.0.0.1:0",
        name="t",
        stats=FrontendStats(),
        pool_workers=1,
        max_frame_bytes=1 << 20,
        sweep_interval_s=0.05,
        drain_timeout_s=1.0,
    )
    yield router
    router.close()


def test_a_reply_failing_midway_never_reaches_another_client(loop: RouterLoop) -> None:
    context = zmq.Context()
    try:
        clients = []
        for _ in range(2):
            client = context.socket(zmq.DEALER)
            client.setsockopt(zmq.RCVTIMEO, 1000)
            client.connect(loop.endpoint)
            clients.append(client)
        first, second = clients
        first.send(b"one")
        identity_first, _ = loop.socket.recv_multipart()
        second.send(b"two")
        identity_second, _ = loop.socket.recv_multipart()
        # The third frame is not something libzmq can send: the identity and header are
        # already queued when it fails.
        assert loop.send([identity_first, b"header", "not bytes"]) is False
        assert loop.stats.failures["reply_dropped"] == 1
        assert loop.send([identity_second, b"for the second client"]) is True
        assert second.recv_multipart() == [b"for the second client"]
        # the first client gets at most its own truncated reply, never the other's frames
        first.setsockopt(zmq.RCVTIMEO, 200)
        with pytest.raises(zmq.Again):
            while True:
                assert b"for the second client" not in first.recv_multipart()
    finally:
        context.destroy(0)


@pytest.mark.parametrize("frames_sent", [1, 2, 3])
def test_a_reply_failing_midway_never_arrives_with_its_full_frame_count(
    loop: RouterLoop, frames_sent: int
) -> None:
    """Whichever frame fails, what reaches the client cannot pass for the whole reply: a
    reply of ``[header, payload, payload]`` whose last payload failed must not arrive as
    three frames, or its receiver would take the filler for the last object's bytes."""
    context = zmq.Context()
    try:
        client = context.socket(zmq.DEALER)
        client.setsockopt(zmq.RCVTIMEO, 1000)
        client.connect(loop.endpoint)
        client.send(b"hello")
        identity, _ = loop.socket.recv_multipart()
        reply: list[object] = [identity, b"header", b"first", b"second"]
        reply[frames_sent] = "not bytes"  # frames before it are queued when it fails
        assert loop.send(reply) is False
        received = client.recv_multipart()
        assert len(received) != len(reply) - 1
        assert received[: frames_sent - 1] == reply[1:frames_sent]
    finally:
        context.destroy(0)


def test_the_receive_queue_holds_a_bounded_number_of_messages_per_connection(loop: RouterLoop) -> None:
    # Messages queued before the loop reads them have had no token checked: libzmq's
    # default of 1000 maximum-size messages per connection is memory an unauthenticated
    # peer could fill.  The bound still leaves room for the native client's default
    # pipelining window (lookup_many's 64 requests in flight).
    queued = loop.socket.getsockopt(zmq.RCVHWM)
    assert queued == 64, queued
