"""RouterLoop's reply plumbing, driven directly over a real ROUTER socket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from router_loops import router_loop

from lmcache_tiers.router import RouterLoop


@pytest.fixture
def loop() -> Iterator[RouterLoop]:
    router = router_loop(drain_timeout_s=1.0)
    yield router
    router.close()


#: how long a message sent over loopback may take to arrive on a machine busy with other
#: work: a bound on a wait for it, never a measure of anything
ARRIVAL_S = 30.0


def received(socket: zmq.Socket[bytes]) -> list[bytes]:
    """The next message on ``socket``, once it has arrived.  The loop's socket has its own
    receive timeout (the sweep interval, 50 ms here), far too short for a message from
    another thread's connection on a loaded machine: wait until a message is there, then
    take it (all its frames arrive together)."""
    assert socket.poll(ARRIVAL_S * 1000, zmq.POLLIN), f"no message within {ARRIVAL_S:g} s"
    return socket.recv_multipart(zmq.NOBLOCK)


def test_a_reply_failing_midway_never_reaches_another_client(loop: RouterLoop) -> None:
    context = zmq.Context()
    try:
        clients = []
        for _ in range(2):
            client = context.socket(zmq.DEALER)
            client.connect(loop.endpoint)
            clients.append(client)
        first, second = clients
        first.send(b"one")
        identity_first, _ = received(loop.socket)
        second.send(b"two")
        identity_second, _ = received(loop.socket)
        # The third frame is not something libzmq can send: the identity and header are
        # already queued when it fails.
        assert loop.send([identity_first, b"header", "not bytes"]) is False
        assert loop.stats.failures["reply_dropped"] == 1
        assert loop.send([identity_second, b"for the second client"]) is True
        assert received(second) == [b"for the second client"]
        # the first client gets its own reply cut short (sent before the second's), and
        # never the other's frames -- in it, or in a message after it
        assert received(first) == [b"header", b"", b""]
        while first.poll(200, zmq.POLLIN):
            assert b"for the second client" not in first.recv_multipart(zmq.NOBLOCK)
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
        client.connect(loop.endpoint)
        client.send(b"hello")
        identity, _ = received(loop.socket)
        reply: list[object] = [identity, b"header", b"first", b"second"]
        reply[frames_sent] = "not bytes"  # frames before it are queued when it fails
        assert loop.send(reply) is False
        arrived = received(client)
        assert len(arrived) != len(reply) - 1
        assert arrived[: frames_sent - 1] == reply[1:frames_sent]
    finally:
        context.destroy(0)


def test_the_receive_queue_holds_a_bounded_number_of_messages_per_connection(loop: RouterLoop) -> None:
    # Messages queued before the loop reads them have had no token checked: libzmq's
    # default of 1000 maximum-size messages per connection is memory an unauthenticated
    # peer could fill.  The bound still leaves room for the native client's default
    # pipelining window (lookup_many's 64 requests in flight).
    queued = loop.socket.getsockopt(zmq.RCVHWM)
    assert queued == 64, queued
