"""When RouterLoop polls for its next request (``request_spin.py``): after a turn that
found one, never after a turn that found nothing for its receive timeout (an idle loop
sleeps on its socket), nor while the pool runs work (its threads need the GIL)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq
from router_loops import router_loop

from lmcache_tiers import router as router_module
from lmcache_tiers.request_spin import RequestSpin
from lmcache_tiers.router import RouterLoop

#: a bound on a wait for another thread on a busy machine, never a measure of anything
WAIT_S = 30.0
WAIT_MS = int(WAIT_S * 1000)


@pytest.fixture
def loop() -> Iterator[RouterLoop]:
    router = router_loop(drain_timeout_s=5.0)
    yield router
    if router._thread is None:
        router.close()


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch, loop: RouterLoop) -> list[int]:
    """The requests on the pool at each poll the loop makes."""
    seen: list[int] = []

    class RecordedSpin(RequestSpin):
        def poll(self) -> None:
            seen.append(loop.in_pool)
            super().poll()

    monkeypatch.setattr(router_module, "RequestSpin", RecordedSpin)
    return seen


def serve(loop: RouterLoop, receive_one: object, sweeps: threading.Semaphore | None = None) -> None:
    def sweep(now: float) -> None:
        if sweeps is not None:
            sweeps.release()

    loop.start(
        receive_one,  # type: ignore[arg-type]
        sweep=sweep,
        on_drain=lambda: None,
        on_shutdown=lambda: None,
        on_failure=lambda exc: None,
    )


def stop(loop: RouterLoop) -> None:
    loop.request_stop()
    assert loop.join(WAIT_S)


def test_an_idle_loop_does_not_poll(loop: RouterLoop, polls: list[int]) -> None:
    def receive_one() -> None:
        try:
            loop.socket.recv_multipart()
        except zmq.Again:
            pass

    sweeps = threading.Semaphore(0)
    serve(loop, receive_one, sweeps)
    try:
        for _ in range(4):  # turns of the receive timeout, nothing received
            assert sweeps.acquire(timeout=WAIT_S)
    finally:
        stop(loop)
    # the first turn's poll alone (nothing yet told the loop it is idle)
    assert len(polls) <= 1


def test_the_loop_polls_after_a_request_but_not_while_the_pool_works(
    loop: RouterLoop, polls: list[int]
) -> None:
    release_work = threading.Event()
    answered = threading.Semaphore(0)
    received: list[bytes] = []

    def receive_one() -> None:
        try:
            identity, body = loop.socket.recv_multipart()
        except zmq.Again:
            return
        if loop.is_waker(identity):  # the pool finished something
            return
        received.append(body)
        if body == b"work":

            def done(result: object, error: BaseException | None) -> None:
                loop.send([identity, b"worked"])

            loop.submit(lambda: release_work.wait(WAIT_S), done)
        else:
            loop.send([identity, body])
        answered.release()

    serve(loop, receive_one)
    context = zmq.Context()
    try:
        client = context.socket(zmq.DEALER)
        client.connect(loop.endpoint)
        client.send(b"before")
        assert client.poll(WAIT_MS) and client.recv() == b"before"
        client.send(b"work")
        assert answered.acquire(timeout=WAIT_S)
        for index in range(3):  # answered by the loop while the pool holds the work
            client.send(b"%d" % index)
            assert client.poll(WAIT_MS) and client.recv() == b"%d" % index
        release_work.set()
        assert client.poll(WAIT_MS) and client.recv() == b"worked"
        client.send(b"after")
        assert client.poll(WAIT_MS) and client.recv() == b"after"
    finally:
        context.destroy(0)
        stop(loop)
    assert received == [b"before", b"work", b"0", b"1", b"2", b"after"]
    assert polls, "the loop never polled"
    assert all(in_pool == 0 for in_pool in polls), polls
