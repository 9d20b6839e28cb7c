"""The requests a front end holds on its pool are bounded: at the bound its loop stops
reading new requests (ZeroMQ's queues then push back on the senders) and goes on
finishing the pool's work and sending its replies, then reads again once the pool has
room.  Work that waits for a later request cannot deadlock it: such a wait ends at its own
deadline, after which the pool drains and the loop reads that request."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from router_loops import router_loop

from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import POOL_RESUME_SHARE

#: requests the loop under test holds on its pool at most
BOUND = 8
#: how long a stalled request, or a wait for an event, lasts at most (a bound, never relied on)
STALL_LIMIT_S = 60.0
#: a bound on waits for the loop, never a measure of it
JOIN_S = 30.0


class GatedPoolLoop:
    """A RouterLoop with one pool thread, its bounds as given, that reads one-frame
    requests, counts them and hands each to ``_serve``; ``gate`` holds the work a subclass
    puts on the pool, and the stop opens it."""

    def __init__(self, max_pool_requests: int, max_pool_bytes: int | None = None) -> None:
        self.stats = FrontendStats()
        self.router = router_loop(
            drain_timeout_s=JOIN_S / 2,
            stats=self.stats,
            max_pool_requests=max_pool_requests,
            max_pool_bytes=max_pool_bytes,
        )
        self.gate = threading.Event()
        #: requests the loop read (loop thread)
        self.received = 0

    def _receive_one(self) -> None:
        router = self.router
        try:
            identity, body = router.socket.recv_multipart()
        except zmq.Again:
            return
        if router.is_waker(identity):
            return
        self.received += 1
        self._serve(identity, body)

    def _serve(self, identity: bytes, body: bytes) -> None:
        """What the loop does with a request it read (on the loop thread)."""
        raise NotImplementedError

    def start(self) -> None:
        self.router.start(
            self._receive_one,
            sweep=lambda now: None,
            on_drain=lambda: None,
            on_shutdown=lambda: None,
            on_failure=print,
        )

    def stop(self) -> None:
        self.gate.set()
        self.router.request_stop()
        assert self.router.join(JOIN_S)


@contextlib.contextmanager
def dealer_to(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER connected to ``endpoint``, its receives bounded by ``JOIN_S``."""
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, int(JOIN_S * 1000))
        sock.connect(endpoint)
        yield sock
    finally:
        context.destroy(0)


class PoolServer(GatedPoolLoop):
    """Serving messages of one frame: ``b"pool"`` runs on the pool until the gate opens,
    ``b"wait"`` on the pool until a later ``b"wake"`` (handled on the loop) or its
    deadline, anything else is echoed from the loop."""

    def __init__(self, *, wait_deadline_s: float = STALL_LIMIT_S) -> None:
        super().__init__(max_pool_requests=BOUND)
        self.woken = threading.Event()
        self.wait_deadline_s = wait_deadline_s
        #: the most requests on the pool seen just after a submit (loop thread)
        self.most_in_pool = 0

    def _serve(self, identity: bytes, body: bytes) -> None:
        router = self.router
        if router.draining:  # as a front end does: nothing new goes to the pool
            router.send([identity, b"refused"])
        elif body == b"pool":
            self._submit(identity, lambda: (self.gate.wait(STALL_LIMIT_S), b"pool done")[1])
        elif body == b"wait":
            self._submit(identity, self._wait)
        elif body == b"wake":
            self.woken.set()
            router.send([identity, b"woke"])
        else:
            router.send([identity, body])

    def _wait(self) -> bytes:
        return b"woken" if self.woken.wait(self.wait_deadline_s) else b"deadline"

    def _submit(self, identity: bytes, work: Callable[[], bytes]) -> None:
        def done(result: Any, error: BaseException | None) -> None:
            self.router.send([identity, result if error is None else b"failed"])

        self.router.submit(work, done)
        self.most_in_pool = max(self.most_in_pool, self.router.in_pool)


@pytest.fixture
def server() -> Iterator[PoolServer]:
    pool_server = PoolServer()
    pool_server.start()
    yield pool_server
    pool_server.stop()


@pytest.fixture
def client(server: PoolServer) -> Iterator[zmq.Socket[bytes]]:
    with dealer_to(server.router.endpoint) as sock:
        yield sock


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Until ``condition`` holds (looked at every millisecond, for ``JOIN_S`` at most)."""
    deadline = time.monotonic() + JOIN_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {JOIN_S:g} s: {what}"
        time.sleep(0.001)


def replies(sock: zmq.Socket[bytes], count: int) -> list[bytes]:
    return [sock.recv() for _ in range(count)]


def test_the_loop_stops_reading_while_its_pool_holds_its_bound(
    server: PoolServer, client: zmq.Socket[bytes]
) -> None:
    sent = 3 * BOUND
    for _ in range(sent):
        client.send(b"pool")
    # Unbounded, the loop reads all of them onto the pool; bounded, it stops at the bound.
    wait_until(
        lambda: server.received == sent or server.stats.pool_backpressure >= 1,
        "every request read, or the loop pausing",
    )
    assert server.most_in_pool <= BOUND
    assert server.received == BOUND
    assert server.router.in_pool == BOUND
    server.gate.set()
    assert replies(client, sent) == [b"pool done"] * sent
    assert server.received == sent
    assert server.most_in_pool <= BOUND
    assert server.stats.pool_backpressure >= 1


def test_replies_go_out_while_the_loop_is_not_reading(server: PoolServer, client: zmq.Socket[bytes]) -> None:
    for _ in range(BOUND):
        client.send(b"pool")
    client.send(b"ping")
    wait_until(lambda: server.stats.pool_backpressure >= 1, "the loop pausing")
    server.gate.set()
    # The ping is read only once the pool is down to its share of the bound: the replies
    # of the requests that ended to make that room went out before it.
    answered = replies(client, BOUND + 1)
    room = BOUND - int(BOUND * POOL_RESUME_SHARE)
    assert answered[:room] == [b"pool done"] * room
    assert sorted(answered) == sorted([b"ping", *[b"pool done"] * BOUND])


def test_a_wait_for_a_later_request_ends_at_its_deadline_and_the_loop_reads_it() -> None:
    """A pool thread waits for a request the paused loop does not read: it is not a
    deadlock, because every wait has its own deadline.  The wait ends there (answered as
    a timeout, as if the later request had come late), the pool drains, and the loop
    reads and answers the later request."""
    server = PoolServer(wait_deadline_s=0.2)
    server.start()
    try:
        with dealer_to(server.router.endpoint) as sock:
            sock.send(b"wait")
            server.gate.set()  # the other pool requests end as soon as they run
            for _ in range(BOUND):
                sock.send(b"pool")
            sock.send(b"wake")
            answered = replies(sock, BOUND + 2)
            # the wait ran first on the one pool thread; the last pool request read with the
            # wake may be answered after it
            assert answered[0] == b"deadline"
            assert sorted(answered[1:]) == sorted([*[b"pool done"] * BOUND, b"woke"])
            assert server.stats.pool_backpressure >= 1
            assert server.most_in_pool <= BOUND
    finally:
        server.stop()


def test_a_stop_requested_while_the_loop_is_not_reading_drains_it(
    server: PoolServer, client: zmq.Socket[bytes]
) -> None:
    for _ in range(BOUND + 1):
        client.send(b"pool")
    wait_until(lambda: server.stats.pool_backpressure >= 1, "the loop pausing")
    server.router.request_stop()
    server.gate.set()
    assert server.router.join(JOIN_S)
    # the pool's requests are answered within the drain; the one left unread is refused
    # if the drain reads it, else never answered
    answered = []
    while client.poll(0, zmq.POLLIN) or answered.count(b"pool done") < BOUND:
        answered.append(client.recv())
    assert answered.count(b"pool done") == BOUND
    assert set(answered) <= {b"pool done", b"refused"}
