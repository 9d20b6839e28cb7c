"""A pool request the stop gives up on (its ``done`` never runs) is never answered: the
router counts it once as ``pool_request_abandoned``, unless its front end says it counts
it itself at the stop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from router_loops import router_loop

from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import ABANDONED_REASON, CountedAtStop

#: how long a stalled request waits for the test at most (the test never relies on it)
STALL_LIMIT_S = 60.0
#: a bound on the stop, never a measure of it
JOIN_S = 30.0
#: the drain of a test whose request must be answered: it ends as soon as the request is
#: (a pool thread a loaded machine starts late must not turn the answer into a give-up)
ANSWERING_DRAIN_S = JOIN_S / 2


def stopped_with(
    requests: list[tuple[Callable[[], Any], CountedAtStop]], drain_timeout_s: float = 0.2
) -> tuple[FrontendStats, list[Any]]:
    """Run a loop (one pool thread, a short drain unless told) with ``requests``
    submitted, stop it and wait for its end; the stats it counted and the results its
    ``done`` got."""
    stats = FrontendStats()
    router = router_loop(drain_timeout_s=drain_timeout_s, stats=stats)

    def receive_one() -> None:
        try:
            router.socket.recv_multipart()
        except zmq.Again:
            pass

    answered: list[Any] = []
    for work, counted in requests:  # before the loop runs: submit is the loop thread's
        router.submit(work, lambda result, error: answered.append(result), counted_at_stop=counted)
    router.start(
        receive_one, sweep=lambda now: None, on_drain=lambda: None, on_shutdown=lambda: None, on_failure=print
    )
    router.request_stop()
    assert router.join(JOIN_S)
    return stats, answered


@pytest.fixture
def stalled() -> Any:
    go_on = threading.Event()

    def work() -> str:
        go_on.wait(STALL_LIMIT_S)
        return "late"

    yield work
    go_on.set()


def test_a_request_running_past_the_drain_deadline_is_counted_once(stalled: Any) -> None:
    # the first runs past the deadline, the second waits behind it in the queue
    stats, answered = stopped_with([(stalled, False), (lambda: "queued", False)])
    assert stats.failures[ABANDONED_REASON] == 2
    assert answered == []


@pytest.mark.parametrize("counted", [True, lambda: True])
def test_a_request_its_front_end_counts_at_the_stop_is_not_counted_again(
    stalled: Any, counted: CountedAtStop
) -> None:
    stats, _ = stopped_with([(stalled, counted)])
    assert ABANDONED_REASON not in stats.failures


def test_only_the_requests_the_front_end_did_not_count_are_counted(stalled: Any) -> None:
    stats, _ = stopped_with([(stalled, lambda: False), (lambda: "queued", lambda: True)])
    assert stats.failures[ABANDONED_REASON] == 1


def test_a_request_answered_within_the_drain_is_not_counted() -> None:
    stats, answered = stopped_with([(lambda: "done", False)], drain_timeout_s=ANSWERING_DRAIN_S)
    assert answered == ["done"]
    assert ABANDONED_REASON not in stats.failures
