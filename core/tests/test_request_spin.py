"""RequestSpin: the loop's poll for its next request stops at a message, at its length,
and at the first sign its thread lost the CPU -- then backs off -- on a clock the test
moves itself (no timing measured)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from lmcache_tiers import request_spin
from lmcache_tiers.request_spin import (
    MAX_SPIN_BACKOFF_S,
    REQUEST_SPIN_S,
    SPIN_BACKOFF_S,
    SPIN_LOST_S,
    RequestSpin,
)

#: what one look and yield take on the test's clock: far under SPIN_LOST_S
STEP_NS = 1_000


class Clock:
    """``perf_counter_ns`` for the module: each reading ``STEP_NS`` after the last, and
    ``jumps`` (reading number -> extra nanoseconds) where the thread is to lose the CPU."""

    def __init__(self) -> None:
        self.now = 10**12
        self.readings = 0
        self.jumps: dict[int, int] = {}

    def __call__(self) -> int:
        self.readings += 1
        self.now += STEP_NS + self.jumps.pop(self.readings, 0)
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(request_spin, "_now_ns", fake)
    monkeypatch.setattr(request_spin, "_yield", lambda: None)
    return fake


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A ROUTER (the loop's socket) and a DEALER connected to it, in process."""
    context = zmq.Context()
    try:
        router = context.socket(zmq.ROUTER)
        router.bind("inproc://request-spin")
        dealer = context.socket(zmq.DEALER)
        dealer.connect("inproc://request-spin")
        yield router, dealer
    finally:
        context.destroy(0)


class Looks:
    """Counts the poll's looks at the socket's events, answering as the socket does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = request_spin._get

        def get(sock: zmq.Socket[bytes], option: int) -> object:
            self.count += 1
            return real(sock, option)

        monkeypatch.setattr(request_spin, "_get", get)


def spin_steps() -> int:
    return int(REQUEST_SPIN_S * 1e9) // STEP_NS


def test_a_message_waiting_ends_the_poll_at_the_first_look(
    clock: Clock, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    router, dealer = pair
    dealer.send(b"request")
    assert router.poll(30_000, zmq.POLLIN)  # arrived (inproc: at once)
    looks = Looks(monkeypatch)
    spin = RequestSpin(router)
    spin.poll()
    assert looks.count == 1
    assert router.recv_multipart(zmq.NOBLOCK)[1] == b"request"
    assert spin.backoffs == 0


def test_a_poll_that_finds_nothing_ends_after_its_length(
    clock: Clock, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    router, _ = pair
    looks = Looks(monkeypatch)
    spin = RequestSpin(router)
    spin.poll()
    # one look per step of the clock until the poll's length has passed, no more
    assert spin_steps() <= looks.count <= spin_steps() + 1
    assert spin.backoffs == 0
    spin.poll()  # nothing lost: the next turn polls again
    assert looks.count > spin_steps() + 1


def test_a_poll_that_loses_its_cpu_stops_and_backs_off(
    clock: Clock, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    router, _ = pair
    looks = Looks(monkeypatch)
    spin = RequestSpin(router)
    clock.jumps[5] = int(2 * SPIN_LOST_S * 1e9)  # the thread is off its CPU between two looks
    spin.poll()
    assert spin.backoffs == 1
    stopped_after = looks.count
    assert stopped_after < 10  # stopped there, not at the poll's length
    # backing off: turns sleep on the socket without a look
    clock.advance(SPIN_BACKOFF_S / 2)
    spin.poll()
    assert looks.count == stopped_after
    # then polls again
    clock.advance(SPIN_BACKOFF_S)
    spin.poll()
    assert looks.count > stopped_after


def test_a_message_that_came_while_the_cpu_was_elsewhere_still_backs_off(
    clock: Clock, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request found after the lost CPU waited for it: the very case polling must stop
    for, though the poll ended at a message."""
    router, dealer = pair
    dealer.send(b"request")
    assert router.poll(30_000, zmq.POLLIN)
    spin = RequestSpin(router)
    clock.jumps[2] = int(2 * SPIN_LOST_S * 1e9)  # between the start and the first look
    spin.poll()
    assert spin.backoffs == 1


def lose_once(spin: RequestSpin, clock: Clock) -> None:
    """A poll whose thread loses the CPU right after its first look."""
    clock.jumps[clock.readings + 2] = int(2 * SPIN_LOST_S * 1e9)
    before = spin.backoffs
    spin.poll()
    assert spin.backoffs == before + 1


def resume_at(spin: RequestSpin) -> float:
    """Seconds from the last loss until the poll resumes."""
    return (spin._resume_ns - spin._lost_at_ns) / 1e9


def test_losses_again_right_after_a_back_off_lengthen_it_up_to_its_bound(
    clock: Clock, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    router, _ = pair
    spin = RequestSpin(router)
    lose_once(spin, clock)
    assert resume_at(spin) == pytest.approx(SPIN_BACKOFF_S)
    expected = SPIN_BACKOFF_S
    for _ in range(12):
        clock.now = spin._resume_ns  # the back-off just ended
        lose_once(spin, clock)
        expected = min(2 * expected, MAX_SPIN_BACKOFF_S)
        assert resume_at(spin) == pytest.approx(expected)
    assert expected == MAX_SPIN_BACKOFF_S


def test_a_loss_after_a_calm_while_backs_off_the_shortest_again(
    clock: Clock, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    router, _ = pair
    spin = RequestSpin(router)
    for _ in range(4):
        clock.now = max(clock.now, spin._resume_ns)
        lose_once(spin, clock)
    assert resume_at(spin) > SPIN_BACKOFF_S
    clock.advance(MAX_SPIN_BACKOFF_S * 4)  # polls that kept their CPU meanwhile
    lose_once(spin, clock)
    assert resume_at(spin) == pytest.approx(SPIN_BACKOFF_S)


def test_a_zero_length_poll_never_looks(
    clock: Clock, pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    router, _ = pair
    looks = Looks(monkeypatch)
    RequestSpin(router, spin_s=0).poll()
    assert looks.count == 0
