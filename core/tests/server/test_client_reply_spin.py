"""A call polls for its reply up to the client's ``reply_spin_s`` before sleeping on it
(client/spin.py): replies taken while polling and replies slept on are the same replies,
a poll ends at its bound, no poll runs when it is off, a call polls and waits within its
own timeout, and a bad value is refused before anything connects."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import pytest
import zmq

import lmcache_tiers.client.connection as connection
from lmcache_tiers.client import Client, RequestTimeoutError
from lmcache_tiers.client.spin import MAX_REPLY_SPIN_S, REPLY_SPIN_S, checked_spin, poll_for_reply
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer


@pytest.fixture
def pair() -> Any:
    """A ROUTER and the DEALER connected to it, in process."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    url = f"inproc://spin-{os.urandom(4).hex()}"
    router.bind(url)
    dealer.connect(url)
    yield router, dealer
    dealer.close(0)
    router.close(0)


def test_a_poll_takes_a_message_that_is_there(pair: Any) -> None:
    router, dealer = pair
    dealer.send(b"hello")
    identity, _ = router.recv_multipart()
    router.send_multipart([identity, b"first", b"second"])
    deadline = time.monotonic() + 10
    frame = None
    while frame is None and time.monotonic() < deadline:
        frame = poll_for_reply(dealer, 1_000_000)
    assert frame is not None and frame.bytes == b"first" and frame.more
    assert dealer.recv() == b"second"


def test_a_poll_that_finds_nothing_ends_at_its_bound(pair: Any) -> None:
    _, dealer = pair
    started = time.perf_counter_ns()
    assert poll_for_reply(dealer, 2_000_000) is None
    assert time.perf_counter_ns() - started >= 2_000_000


def test_no_poll_runs_when_it_is_off(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, dealer = pair

    def polled(*args: object) -> None:
        raise AssertionError("polled with the spin off")

    monkeypatch.setattr("lmcache_tiers.client.spin._recv", polled)
    monkeypatch.setattr("lmcache_tiers.client.spin._get", polled)
    assert poll_for_reply(dealer, 0) is None


@pytest.mark.parametrize(
    "bad", [math.nan, -1e-6, MAX_REPLY_SPIN_S * 2, math.inf, True, "0.001", None], ids=repr
)
def test_a_bad_spin_is_refused_before_anything_connects(bad: Any) -> None:
    with pytest.raises(ValueError, match="reply_spin_s must"):
        Client("tcp://127.0.0.1:1", reply_spin_s=bad)


def test_the_spin_bounds_are_taken_as_floats() -> None:
    assert checked_spin(0) == 0.0 and type(checked_spin(0)) is float
    assert checked_spin(MAX_REPLY_SPIN_S) == MAX_REPLY_SPIN_S
    assert 0 < REPLY_SPIN_S <= MAX_REPLY_SPIN_S


def _poll_until_a_frame(sock: Any, spin_ns: int) -> Any:
    """A poll that takes the reply however late it comes (within 10 s)."""
    deadline = time.monotonic() + 10
    while (frame := poll_for_reply(sock, 1_000_000)) is None:
        assert time.monotonic() < deadline, "no reply in 10 s"
    return frame


def _poll_finding_nothing(sock: Any, spin_ns: int) -> Any:
    return None


@pytest.mark.parametrize(
    "poll", [_poll_until_a_frame, _poll_finding_nothing, poll_for_reply], ids=["polled", "slept-on", "off"]
)
def test_replies_polled_for_and_slept_on_are_the_same_replies(
    server: TiersServer, poll: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every reply taken by the poll, every reply slept on after a poll that found nothing,
    and no poll at all (``reply_spin_s=0``): every call answers the same either way.
    Which of the first two happens is forced, not left to when the server answers: an
    in-process server often answers before the caller gets the GIL back from its send."""
    spin = 0.0 if poll is poll_for_reply else MAX_REPLY_SPIN_S
    polls: list[tuple[int, bool]] = []

    def counted(sock: Any, spin_ns: int) -> Any:
        frame = poll(sock, spin_ns)
        polls.append((spin_ns, frame is not None))
        return frame

    monkeypatch.setattr(connection, "poll_for_reply", counted)
    keys = [ObjectKey("spin", 0, os.urandom(8)) for _ in range(3)]
    payloads = [os.urandom(256) for _ in keys]
    with Client(server.endpoint, reply_spin_s=spin) as client:
        assert client.store(keys, payloads) == 3
        assert client.lookup(keys) == 3
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == payloads
        assert client.lookup([*keys, ObjectKey("spin", 0, os.urandom(8))]) == 3
        assert client.release(keys) == 3
        assert client.ping() > 0
    assert len(polls) >= 6, "calls left the usual round trip"
    assert {spin_ns for spin_ns, _ in polls} == {int(spin * 1e9)}
    assert {taken for _, taken in polls} == {poll is _poll_until_a_frame}


class _Clock:
    """``time`` for connection.py, whose monotonic clock a test moves on."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.parametrize(
    ("spin", "timeout"),
    [(MAX_REPLY_SPIN_S, MAX_REPLY_SPIN_S / 2), (REPLY_SPIN_S, 0.001)],
    ids=["max", "default"],
)
def test_a_short_call_polls_and_waits_within_its_own_time(
    server: TiersServer, spin: float, timeout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose timeout is shorter than its poll and the least blocking wait (1 ms)
    together polls for its timeout and no longer, then waits no more: here the poll (made
    to take its whole bound) used it all up, and the call times out without a receive.  It
    used to poll up to ``reply_spin_s`` past a timeout shorter than that, or poll 0.5 ms of
    a 1 ms one, then wait a whole slice (the timeout again, or 1 ms) on top."""
    clock = _Clock()
    bounds: list[int] = []
    receives: list[int] = []
    receive = connection._raw_recv

    def poll_taking_its_bound(sock: Any, spin_ns: int) -> Any:
        bounds.append(spin_ns)
        clock.ahead += spin_ns / 1e9
        return None

    def counted_receive(sock: Any, flags: int, copy: bool) -> Any:
        receives.append(flags)
        return receive(sock, flags, copy)

    with Client(server.endpoint, reply_spin_s=spin) as client:
        monkeypatch.setattr(connection, "time", clock)
        monkeypatch.setattr(connection, "poll_for_reply", poll_taking_its_bound)
        monkeypatch.setattr(connection, "_raw_recv", counted_receive)
        with pytest.raises(RequestTimeoutError):
            client.ping(timeout=timeout)
        assert bounds == [int(timeout * 1e9)]
        assert receives == []
        # A short call with more time than that polls for its spin, then waits for the
        # rest (bounded by its deadline, not by the slice set before the poll).
        assert client.ping(timeout=0.2) > 0
        assert bounds[1:] == [int(spin * 1e9)]
        monkeypatch.undo()
        assert client.ping() > 0  # the late reply is dropped on the way
