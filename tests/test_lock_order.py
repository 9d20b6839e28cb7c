"""Lock order and blocking under the L1 lock, traced over in-process tests.

The tracer (tests/lock_tracer.py) runs as a pytest plugin in a child pytest: it wraps the
locks the project's modules create, records which lock each thread takes while holding
which, and which blocking calls it makes while holding one.  A cycle in that order (A
taken before B on one path, B before A on another) is a deadlock waiting for two threads to
meet; a blocking call under the L1 lock stalls every reader and writer of L1 meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

#: in-process tests that take the L1 lock, the store, prefetch and eviction controllers'
#: locks, the L2 adapter's and circuit breaker's and the NVMe L1 file's, in a few seconds.
#: Each adds lock orders the others do not take; the store, L2 eviction refusal and
#: native front end lease tests and the other NVMe write-back tests were left out: every
#: order they take, these take too, and the run stays short on a loaded machine.
TRACED_TESTS = [
    "core/tests/engine/test_eviction.py",
    "core/tests/engine/test_eviction_circuit.py",
    "core/tests/engine/test_start_prefetch.py",
    "core/tests/l1/test_l1_nvme_writeback.py::test_a_write_back_store_refused_one_object_stores_the_others",
]

#: locks whose holder must not block: every L1 call waits for the L1 lock, and the
#: storage's close lock is taken by every close
NEVER_BLOCKED_UNDER = ("lmcache_tiers/l1/manager.py", "lmcache_tiers/storage.py")


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def _traced_script(code: str, tmp_path: Path) -> dict:
    """Run ``code`` as if it were in the project's L2 package, under the tracer."""
    script = tmp_path / "traced.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, sys
            import lock_tracer
            namespace = {{"__name__": "lmcache_tiers.l2.traced_probe"}}
            exec({code!r}, namespace)
            json.dump(lock_tracer.report(), sys.stdout)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], env=_environment(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_tracer_reports_two_locks_taken_in_both_orders(tmp_path: Path) -> None:
    report = _traced_script(
        textwrap.dedent(
            """
            import threading
            first = threading.Lock()
            second = threading.Lock()
            def forward():
                with first, second:
                    pass
            def backward():
                with second, first:
                    pass
            for target in (forward, backward):  # one after the other: traced, not deadlocked
                thread = threading.Thread(target=target)
                thread.start()
                thread.join()
            """
        ),
        tmp_path,
    )
    assert len(report["inversions"]) == 1, report
    assert "forward" in " ".join(report["inversions"][0]["sites"])
    assert "backward" in " ".join(report["inversions"][0]["sites"])


def test_the_tracer_reports_a_ring_of_three_locks_and_a_sleep_under_a_lock(tmp_path: Path) -> None:
    report = _traced_script(
        textwrap.dedent(
            """
            import threading, time
            a = threading.Lock()  # one lock per line: a lock is named by its line
            b = threading.RLock()
            c = threading.Condition()
            with a, b:
                pass
            with b, c:
                pass
            with c, a:
                time.sleep(0)
            with b:
                with c:  # a wait releases the condition's own lock, not the others held
                    c.wait(0)
            """
        ),
        tmp_path,
    )
    assert len(report["inversions"]) == 1, report
    assert report["inversions"][0]["locks"].count("->") == 3
    calls = sorted(entry["call"] for entry in report["blocking_under_lock"])
    # the sleep under both locks held (c and a); the wait under b alone, not under c
    assert calls == ["Condition.wait", "time.sleep", "time.sleep"], report


def test_the_in_process_tests_take_locks_in_one_order_and_never_block_under_l1(tmp_path: Path) -> None:
    report_path = tmp_path / "locks.json"
    env = _environment()
    env["LOCK_TRACER_REPORT"] = str(report_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "lock_tracer", "-q", *TRACED_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["edges"], "the tracer saw no lock taken under another: is it installed?"
    assert report["inversions"] == [], json.dumps(report["inversions"], indent=1)
    blocked = [
        entry for entry in report["blocking_under_lock"] if entry["held"].startswith(NEVER_BLOCKED_UNDER)
    ]
    assert blocked == [], json.dumps(blocked, indent=1)
