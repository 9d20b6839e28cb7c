"""The process ends once the server stopped, even with a thread stuck in a call."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# A pool thread stuck for good (a read on a hung mount): Python's exit would join it.
_STUCK = textwrap.dedent(
    """
    import logging, sys, threading
    from concurrent.futures import ThreadPoolExecutor
    from lmcache_tiers.server.leave import leave_past_stuck_threads

    logging.basicConfig(level=logging.INFO)
    never = threading.Event()
    pool = ThreadPoolExecutor(1, thread_name_prefix="stuck-read")
    pool.submit(never.wait)
    quick = threading.Thread(target=lambda: None, name="ends-by-itself")
    quick.start()
    print("stopped", flush=True)
    leave_past_stuck_threads(int(sys.argv[1]), linger_s=0.2)
    print("not reached while a thread is stuck", flush=True)
    """
)

_NOTHING_STUCK = textwrap.dedent(
    """
    import sys
    from lmcache_tiers.server.leave import leave_past_stuck_threads

    leave_past_stuck_threads(0, linger_s=0.2)
    print("returned")
    sys.exit(3)
    """
)


def test_a_thread_stuck_in_a_call_does_not_keep_the_process_from_ending() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _STUCK, "5"], capture_output=True, text=True, timeout=60
    )  # the timeout is a guard: without the helper the process never ends
    assert done.returncode == 5, done.stderr
    assert "stopped" in done.stdout and "not reached" not in done.stdout
    assert "1 threads are still stuck in calls after the stop (stuck-read_0)" in done.stderr


def test_with_nothing_stuck_it_returns_and_the_process_exits_as_it_would() -> None:
    done = subprocess.run([sys.executable, "-c", _NOTHING_STUCK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "returned" in done.stdout, done.stderr


# Two threads blocked for good reading a FIFO nobody writes; the first one's join() creates
# MARKER, so the test's Ctrl-C comes while the process lingers for them (linger_s: far longer
# than the test).  Two, because Python (3.11) takes a thread whose join a KeyboardInterrupt
# cut short for stopped, and its exit then waits only for the others.
_STUCK_ON_A_FIFO = textwrap.dedent(
    """
    import logging, os, pathlib, sys, threading
    from lmcache_tiers.server.leave import leave_past_stuck_threads

    fifo, marker = sys.argv[1], sys.argv[2]
    os.mkfifo(fifo)

    class Reading(threading.Thread):
        def join(self, timeout=None):
            pathlib.Path(marker).touch()
            super().join(timeout)

    def read():
        with open(fifo, "rb") as stuck:  # blocks: no writer ever opens it
            stuck.read()

    logging.basicConfig(level=logging.INFO)
    Reading(target=read, name="fifo-read-1").start()
    Reading(target=read, name="fifo-read-2").start()
    leave_past_stuck_threads(4, linger_s=3600)
    print("not reached while a thread is stuck", flush=True)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_it_lingers_leaves_at_once_with_the_code_of_the_stop(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """A Ctrl-C in the linger raised KeyboardInterrupt there, and Python's exit then joined
    the stuck threads: the process hung until a second Ctrl-C.  A SIGTERM there ended the
    process by the signal (exit -15), the stop's code lost."""
    marker = tmp_path / "lingering"
    process = subprocess.Popen(
        [sys.executable, "-c", _STUCK_ON_A_FIFO, str(tmp_path / "fifo"), str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Python installs its own
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "it never lingered"
            time.sleep(0.02)
        process.send_signal(sig)
        try:
            out, err = process.communicate(timeout=60)  # a guard: for SIGINT on old code it never ends
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process went on waiting for the stuck threads after {sig.name}")
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 4, err
    assert "not reached" not in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"WARNING:lmcache_tiers.server:{sig.name} while waiting for 2 threads still in calls after the stop"
        " (fifo-read-1, fifo-read-2): exiting without waiting for them"
    ], err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_handlers_are_given_back_after_a_signal_with_nothing_left_stuck(sig: signal.Signals) -> None:
    """A signal in the linger leaves SIG_DFL behind (a second one ends a process leaving
    past stuck threads at once); when no thread was stuck after all, the process exits as
    it would, and SIGINT must raise KeyboardInterrupt again, not kill it by the signal."""
    from lmcache_tiers.server.leave import _StopWhileLingering

    before = {each: signal.getsignal(each) for each in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        stop = _StopWhileLingering.take()
        assert stop is not None
        assert signal.getsignal(signal.SIGINT) is stop and signal.getsignal(signal.SIGTERM) is stop
        stop(sig, None)  # the signal, as it is delivered
        stop.give_back()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)
