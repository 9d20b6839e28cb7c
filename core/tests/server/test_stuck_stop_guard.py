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
guard = StuckStopGuard(stops, (), files, has_l2=pending != "none", pending_l2_stores=count, window_s=0.5)
guard.start()
held = threading.Lock()
held.acquire()
ready.touch()
held.acquire()  # the main thread waits for good
"""


def _ended(tmp_path: Path, pending: str, *, replace_segment: bool = False) -> tuple[int, str, Path]:
    """Start the process, send SIGTERM then SIGINT (a second signal: the stop is forced);
    its exit status, its stderr and the segment's path."""
    segment, ready = tmp_path / "segment", tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROCESS, str(segment), str(ready), pending],
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
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, stderr, segment


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith("error: the stop failed: the stop forced by a second signal"), stderr
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
