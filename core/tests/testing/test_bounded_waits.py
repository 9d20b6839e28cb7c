"""The bounded waits of lmcache_tiers.testing.threads: a wait that never ends fails naming what
it awaited, instead of hanging the pytest worker until the suite's timeout."""

from __future__ import annotations

import threading

import pytest

from lmcache_tiers.testing.threads import joined, wait_until


def test_wait_until_returns_once_the_condition_holds() -> None:
    polls = iter([False, False, True])
    wait_until(lambda: next(polls), "the third poll")
    assert next(polls, None) is None, "polled again after the condition held"


def test_wait_until_fails_naming_what_never_happened() -> None:
    with pytest.raises(AssertionError, match="waiting for the gate to open"):
        wait_until(lambda: False, "the gate to open", timeout=0.05)


def test_joined_fails_naming_what_a_stuck_thread_was_doing() -> None:
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="test-stuck", daemon=True)
    stuck.start()
    try:
        with pytest.raises(AssertionError, match=r"test-stuck still running .*: a call that never returns"):
            joined(stuck, "a call that never returns", timeout=0.05)
    finally:
        release.set()
    joined(stuck, "the released call")
