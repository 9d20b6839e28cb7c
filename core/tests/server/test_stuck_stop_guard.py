"""The guard that ends a forced stop a stuck thread holds up: its exit status and files.

Each test runs a small process whose main thread waits for good on a lock (as serve's
does behind a stuck plugin), with a guard over a file standing for the L1 segment, and
signals it: the guard alone can end it.  What L2 still had pending decides the status:
1 (the stop failed) when the pending stores were counted as none, 3 otherwise -- also
when they could not be counted, since acknowledged writes may then be lost.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: a generous guard against a test that would otherwise hang: not a measured time
_GUARD_S = 60.0

PROCESS = """
import signal
import sys
import threading
import time
from pathlib import Path

from lmcache_tiers.server.stuck_stop import CreatedFile, StuckStopGuard

segment, ready, pending = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
graceful = float(sys.argv[4]) if sys.argv[4] != "none" else None
segment.write_bytes(b"L1")
mapped = segment.open("rb")  # held, as serve holds its segment: its inode is not reused
stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
for sig in stops:
    signal.signal(sig, lambda signum, frame: None)  # as serve's: flags only


def count():
    if pending == "stuck":
        time.sleep(3600)  # its lock is held by the stuck thread
    return int(pending)


files = [CreatedFile.of(str(segment), "the L1 segment")]
has_l2 = pending != "none"
guard = StuckStopGuard(
    stops, (), files, has_l2=has_l2, pending_l2_stores=count, window_s=0.5, graceful_window_s=graceful
)
guard.start()
held = threading.Lock()
held.acquire()
ready.touch()
held.acquire()  # the main thread waits for good
"""


def _ended(
    tmp_path: Path,
    pending: str,
    *,
    replace_segment: bool = False,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
    graceful_window_s: float | None = None,
) -> tuple[int, str, Path]:
    """Start the process, send ``signals`` (by default SIGTERM then SIGINT: a second
    signal, the stop is forced); its exit status, its stderr and the segment's path."""
    segment, ready = tmp_path / "segment", tmp_path / "ready"
    graceful = "none" if graceful_window_s is None else str(graceful_window_s)
    proc = subprocess.Popen(
        [sys.executable, "-c", PROCESS, str(segment), str(ready), pending, graceful],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + _GUARD_S
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.02)
        if replace_segment:  # another file under the name now: not the guard's to remove
            segment.unlink()
            segment.write_bytes(b"not ours")
        for sig in signals:
            proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, stderr, segment


def _error_line(stderr: str, why: str = "the stop forced by a second signal") -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(f"error: the stop failed: {why}"), stderr
    return errors[0]


@pytest.mark.parametrize(
    ("pending", "code", "said"),
    [
        ("none", 1, "no L2, no acknowledged write waits for one"),
        ("0", 1, "no L2 store was pending"),
        ("3", 3, "3 L2 stores not waited for; the writes they hold, acknowledged to clients, are lost"),
        ("stuck", 3, "the pending L2 stores could not be counted"),
    ],
)
def test_the_status_says_whether_acknowledged_writes_may_be_lost(
    tmp_path: Path, pending: str, code: int, said: str
) -> None:
    status, stderr, segment = _ended(tmp_path, pending)
    assert status == code, stderr
    assert said in _error_line(stderr)
    assert not segment.exists(), "the L1 segment outlived the stop"


def test_a_file_that_took_the_segment_s_name_is_left_alone(tmp_path: Path) -> None:
    status, stderr, segment = _ended(tmp_path, "none", replace_segment=True)
    assert status == 1, stderr
    _error_line(stderr)
    assert segment.read_bytes() == b"not ours"


def test_a_graceful_stop_still_running_past_its_window_is_ended(tmp_path: Path) -> None:
    status, stderr, segment = _ended(tmp_path, "3", signals=(signal.SIGTERM,), graceful_window_s=0.5)
    assert status == 3, stderr
    line = _error_line(stderr, "the stop begun by SIGTERM did not finish within 0.5s")
    assert "3 L2 stores not waited for" in line
    assert not segment.exists(), "the L1 segment outlived the stop"


def test_a_second_signal_during_a_graceful_stop_forces_it_sooner(tmp_path: Path) -> None:
    # The graceful window outlasts the test's own guard: only the forced one can end it.
    status, stderr, _ = _ended(tmp_path, "0", graceful_window_s=600.0)
    assert status == 1, stderr
    _error_line(stderr, "the stop forced by a second signal did not finish within 0.5s")
