"""DataPlaneActivity: when background work counts the data plane as quiet."""

from __future__ import annotations

import pytest

from lmcache_tiers.activity import DataPlaneActivity


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_quiet_until_something_is_reported() -> None:
    assert DataPlaneActivity().quiet_in() == 0.0


def test_a_touch_keeps_it_busy_for_the_linger() -> None:
    clock = Clock()
    activity = DataPlaneActivity(linger_s=0.5, clock=clock)
    activity.touch()
    assert activity.quiet_in() == pytest.approx(0.5)
    clock.now += 0.2
    assert activity.quiet_in() == pytest.approx(0.3)
    clock.now += 0.3
    assert activity.quiet_in() == 0.0


def test_an_open_span_keeps_it_busy_until_it_ends() -> None:
    clock = Clock()
    activity = DataPlaneActivity(linger_s=0.1, stale_s=10.0, clock=clock)
    activity.begin("copy")
    clock.now += 5.0
    assert activity.quiet_in() == pytest.approx(5.0)  # until it would go stale
    activity.end("copy")
    assert activity.quiet_in() == pytest.approx(0.1)  # the linger after its end
    clock.now += 0.1
    assert activity.quiet_in() == 0.0


def test_a_span_whose_end_never_comes_stops_counting() -> None:
    clock = Clock()
    activity = DataPlaneActivity(linger_s=0.0, stale_s=10.0, clock=clock)
    activity.begin("lost")
    clock.now += 9.0
    assert activity.quiet_in() == pytest.approx(1.0)
    assert activity.spans() == 1
    clock.now += 1.0
    assert activity.quiet_in() == 0.0
    assert activity.spans() == 0, "a stale span is forgotten"


def test_spans_end_by_token_and_many_at_once() -> None:
    clock = Clock()
    activity = DataPlaneActivity(linger_s=0.0, stale_s=10.0, clock=clock)
    activity.begin_many(["a", "b", "c"])
    activity.end_many(["a", "c", "never-begun"])
    assert activity.spans() == 1
    assert activity.quiet_in() == pytest.approx(10.0)
    activity.end("b")
    assert activity.spans() == 0
    assert activity.quiet_in() == 0.0


def test_a_span_begun_again_counts_from_its_new_start() -> None:
    clock = Clock()
    activity = DataPlaneActivity(linger_s=0.0, stale_s=10.0, clock=clock)
    activity.begin("x")
    clock.now += 4.0
    activity.begin("y")
    clock.now += 4.0
    activity.begin("x")  # e.g. a key reserved again after its reservation expired
    clock.now += 4.0  # x's first start would be stale now, y is not
    assert activity.quiet_in() == pytest.approx(2.0)  # y, begun 8 s ago, decides
    clock.now += 2.0
    assert activity.quiet_in() == pytest.approx(4.0)  # y went stale; x's second start decides
    assert activity.spans() == 1


def test_spans_whose_end_never_comes_do_not_pile_up_when_nobody_asks() -> None:
    # A server without L2 adapters has no write-back to pace: nothing calls quiet_in, yet
    # every reservation a client abandons (it died between reserve and commit) begins a
    # span that no end ever comes for.
    clock = Clock()
    activity = DataPlaneActivity(linger_s=0.0, stale_s=1.0, clock=clock)
    for round_index in range(100):
        activity.begin_many([(round_index, index) for index in range(100)])
        clock.now += 2.0
    activity.begin("live")
    assert activity.spans() <= 101, "stale spans are forgotten without a quiet_in"
    assert activity.quiet_in() == pytest.approx(1.0)  # the live one still counts


class WalkCountingSpans(dict):  # type: ignore[type-arg]
    """The spans, counting how often their oldest is looked for."""

    walks = 0

    def items(self):  # type: ignore[no-untyped-def,override]
        self.walks += 1
        return super().items()


def test_beginning_spans_looks_for_stale_ones_at_most_once_per_stale_s() -> None:
    # Finding the oldest span skips the holes ended spans left at the front of the dict:
    # after a burst of spans ended, tens of microseconds a call.  The request path pays
    # for that once per stale_s, not on every begin.
    clock = Clock()
    activity = DataPlaneActivity(linger_s=0.0, stale_s=1.0, clock=clock)
    spans = activity._spans = WalkCountingSpans()
    for index in range(1000):
        activity.begin(index)
        activity.begin_many([("many", index)])
        activity.end(index)
        clock.now += 0.001
    assert spans.walks <= 2
    clock.now += 5.0
    activity.begin("late")
    assert activity.spans() == 1, "stale spans are still forgotten as new ones begin"
