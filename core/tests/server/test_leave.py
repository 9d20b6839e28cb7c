"""The process ends once the server stopped, even with a thread stuck in a call."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
