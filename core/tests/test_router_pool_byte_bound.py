"""The bytes of the requests a front end holds on its pool are bounded, not only their
number: a request may carry up to the front end's largest message (a native inline
STORE, up to ``max_request_bytes``), so a bound on requests alone caps nothing like
memory.  While the messages of the requests on the pool add up to the byte bound the
loop reads no more, and it reads again once both bounds are under their share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from test_router_pool_bound import STALL_LIMIT_S, GatedPoolLoop, dealer_to, replies, wait_until

from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import POOL_RESUME_SHARE, RouterLoop

#: the size of each request message the tests send
MESSAGE = 1000
#: requests whose messages reach the byte bound
AT_BOUND = 4
#: far more requests than the tests send: only the byte bound can hold the loop
REQUEST_BOUND = 1000


class ByteBoundServer(GatedPoolLoop):
    """A byte bound of ``AT_BOUND`` messages: every message runs on the pool until the
    gate opens, counted at its own size."""

    def __init__(self, max_pool_bytes: int = AT_BOUND * MESSAGE) -> None:
        super().__init__(max_pool_requests=REQUEST_BOUND, max_pool_bytes=max_pool_bytes)
        #: the most bytes on the pool seen just before a request was read (loop thread)
        self.most_bytes_before_a_read = 0

    def _serve(self, identity: bytes, body: bytes) -> None:
        router = self.router
        self.most_bytes_before_a_read = max(self.most_bytes_before_a_read, router.pool_bytes)
        if router.draining:
            router.send([identity, b"refused"])
            return

        def done(result: Any, error: BaseException | None) -> None:
            router.send([identity, result if error is None else b"failed"])

        def work() -> bytes:
            self.gate.wait(STALL_LIMIT_S)
            return b"done %d" % len(body)

        router.submit(work, done, message_bytes=len(body))


@pytest.fixture
def server() -> Iterator[ByteBoundServer]:
    byte_server = ByteBoundServer()
    byte_server.start()
    yield byte_server
    byte_server.stop()


@pytest.fixture
def client(server: ByteBoundServer) -> Iterator[zmq.Socket[bytes]]:
    with dealer_to(server.router.endpoint) as sock:
        yield sock


def test_the_loop_stops_reading_while_its_pool_holds_its_bound_of_bytes(
    server: ByteBoundServer, client: zmq.Socket[bytes]
) -> None:
    sent = 3 * AT_BOUND
    for _ in range(sent):
        client.send(b"x" * MESSAGE)
    # Bounded by requests alone (far above what is sent), the loop reads every one onto
    # the pool; bounded by bytes too, it stops once their messages reach the byte bound.
    wait_until(
        lambda: server.received == sent or server.stats.pool_backpressure >= 1,
        "every request read, or the loop pausing",
    )
    assert server.received == AT_BOUND
    assert server.router.in_pool == AT_BOUND
    assert server.router.pool_bytes == AT_BOUND * MESSAGE
    assert server.stats.pool_backpressure == 1
    assert server.stats.pool_backpressure_bytes == 1  # the byte bound held, not the request bound
    server.gate.set()
    assert replies(client, sent) == [b"done %d" % MESSAGE] * sent
    wait_until(lambda: server.router.in_pool == 0, "the pool emptied")
    assert server.router.pool_bytes == 0
    assert server.most_bytes_before_a_read < AT_BOUND * MESSAGE


def test_reading_resumes_only_once_the_bytes_are_down_to_their_share(
    server: ByteBoundServer, client: zmq.Socket[bytes]
) -> None:
    for _ in range(AT_BOUND):
        client.send(b"x" * MESSAGE)
    client.send(b"ping")
    wait_until(lambda: server.stats.pool_backpressure >= 1, "the loop pausing")
    server.gate.set()
    # The ping is read only once the bytes on the pool are down to their share of the
    # bound: the replies of the requests that ended to make that room went out before it.
    answered = replies(client, AT_BOUND + 1)
    room = AT_BOUND - int(AT_BOUND * MESSAGE * POOL_RESUME_SHARE) // MESSAGE
    assert answered[:room] == [b"done %d" % MESSAGE] * room
    assert sorted(answered) == sorted([b"done 4", *[b"done %d" % MESSAGE] * AT_BOUND])


def test_a_request_larger_than_the_byte_bound_is_read_and_served_alone() -> None:
    """The size of a request is known only once it is read: one larger than the whole
    bound is read while the pool is under it, then holds the loop until it ends (no
    deadlock), and the next request is read after that."""
    server = ByteBoundServer(max_pool_bytes=MESSAGE)
    server.start()
    try:
        with dealer_to(server.router.endpoint) as sock:
            sock.send(b"x" * (3 * MESSAGE))
            sock.send(b"small")
            wait_until(lambda: server.stats.pool_backpressure >= 1, "the loop pausing")
            assert server.received == 1
            assert server.router.pool_bytes == 3 * MESSAGE
            server.gate.set()
            assert replies(sock, 2) == [b"done %d" % (3 * MESSAGE), b"done 5"]
            assert server.stats.pool_backpressure_bytes >= 1
    finally:
        server.stop()


def test_a_byte_bound_under_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="max_pool_bytes"):
        RouterLoop(
            "tcp://127.0.0.1:0",
            name="t",
            stats=FrontendStats(),
            pool_workers=1,
            max_pool_bytes=0,
            max_frame_bytes=1 << 20,
            sweep_interval_s=0.05,
            drain_timeout_s=1.0,
        )
