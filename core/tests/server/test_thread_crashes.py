"""``ThreadCrashes`` as ``threading.excepthook``: what it leaves behind once uninstalled,
and a crash it must report even when counting it fails."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from lmcache_tiers.server.thread_crashes import THREAD_CRASHED, ThreadCrashes


@pytest.fixture
def original_hook() -> Iterator[object]:
    hook = threading.excepthook
    yield hook
    threading.excepthook = hook  # whatever a failing test left


def crash_a_thread(name: str) -> None:
    def crash() -> None:
        raise RuntimeError("injected thread crash")

    thread = threading.Thread(target=crash, name=name)
    thread.start()
    thread.join()


def test_two_servers_closed_in_start_order_put_back_the_hook_they_found(original_hook: object) -> None:
    """The first server's close finds the second's hook in place and leaves it; the
    second's close must not put back the first's, closed: it would stay for good, holding
    that server (and what it references) for the rest of the process."""
    counted: list[str] = []
    first, second = ThreadCrashes(counted.append), ThreadCrashes(counted.append)
    first.install()
    second.install()
    first.uninstall()
    second.uninstall()
    assert threading.excepthook == original_hook


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crash_is_logged_even_when_counting_it_fails(
    original_hook: object, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook raising would replace the thread's traceback by its own on stderr: the
    crash itself would then be neither counted nor logged."""

    def count(reason: str) -> None:
        raise RuntimeError(f"injected counting failure for {reason}")

    crashes = ThreadCrashes(count)
    crashes.install()
    try:
        with caplog.at_level(logging.ERROR, logger="lmcache_tiers"):
            crash_a_thread("crash-while-counting-fails")
    finally:
        crashes.uninstall()
    logged = [record for record in caplog.records if "crash-while-counting-fails" in record.getMessage()]
    assert logged and THREAD_CRASHED in logged[0].getMessage(), caplog.text
