"""A controller's ``next_step_in`` and ``busy`` run in its loop outside the step's guard:
one of them raising (a bug) must cost a counted, logged step error, never the thread that
releases everyone's locks."""

from __future__ import annotations

import logging

import pytest

from lmcache_tiers.controllers.base import ControllerThread

#: rounds of a step that fails on each
ROUNDS = 20


class RaisingHooks(ControllerThread):
    """Counts its steps; its ``next_step_in`` and (once stopping) ``busy`` raise when told."""

    def __init__(self) -> None:
        super().__init__("raising-hooks-probe", interval_s=3600.0)
        self.steps = 0
        self.next_step_in_raises = False
        self.busy_raises = False
        self.finished = False

    def step(self, ready_fds: set[int]) -> None:
        self.steps += 1

    def next_step_in(self) -> float | None:
        if self.next_step_in_raises:
            raise RuntimeError("injected next_step_in bug")
        return None

    def busy(self) -> bool:
        if self.busy_raises and self.stopping:
            raise RuntimeError("injected busy bug")
        return False

    def finish(self) -> None:
        self.finished = True


def test_next_step_in_raising_is_a_step_error_and_the_loop_goes_on() -> None:
    controller = RaisingHooks()
    controller.next_step_in_raises = True
    controller.start()
    try:
        assert controller.wait_idle(timeout=30.0)
        stepped = controller.steps
        assert controller.wait_idle(timeout=30.0)
        assert controller.steps > stepped, "the controller's thread ended"
        assert controller.step_errors >= 1
    finally:
        assert controller.stop(drain_timeout_s=0.0)
    assert controller.finished


def test_busy_raising_while_stopping_is_a_step_error_and_the_drain_deadline_ends_it() -> None:
    controller = RaisingHooks()
    controller.busy_raises = True
    controller.start()
    assert controller.wait_idle(timeout=30.0)
    assert controller.stop(drain_timeout_s=0.2)
    assert controller.finished
    assert controller.step_errors >= 1


class FailingSteps(ControllerThread):
    """A step with a bug: it raises on every round."""

    def __init__(self) -> None:
        super().__init__("failing-steps-probe", interval_s=3600.0)

    def step(self, ready_fds: set[int]) -> None:
        raise RuntimeError("injected step bug")


def test_a_step_failing_on_every_round_is_traced_once_then_logged_per_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A controller steps on every wake-up (each request, for some): a traceback per
    failing round would bury the log; the counter has every one of them."""
    controller = FailingSteps()
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.controllers"):
        controller.start()
        try:
            for _ in range(ROUNDS):
                assert controller.wait_idle(timeout=30.0)
        finally:
            assert controller.stop(drain_timeout_s=0.0)
    assert controller.step_errors >= ROUNDS
    lines = [record for record in caplog.records if "failing-steps-probe" in record.getMessage()]
    traced = [record for record in lines if record.exc_info is not None]
    assert len(traced) == 1, caplog.text
    assert len(lines) < ROUNDS / 2, caplog.text
