"""A store storm through a slot store, run in a child process killed by the tests.

The writer stores object ``i`` under ``make_keys(1, start=i)`` with the bytes of
:func:`expected`, keeps at most :data:`LIVE` objects (deleting the oldest batch before
storing a new one once there are that many, so slots are reused all the time) and prints
``stored N`` after every acknowledged store and ``deleted N`` after every delete, so the
parent knows which objects must survive the kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

from slot_helpers import client

from lmcache_tiers.testing.l2 import make_keys, pattern

BATCH = 8
#: slots of the storm's device: LIVE objects, the rest absorbing writes in flight
SLOTS = 256
LIVE = 192
MIN_SIZE = 20_000


def object_size(index: int, largest: int) -> int:
    # Sizes vary so that kills land in writes of different lengths and alignments.
    return MIN_SIZE + (index * 7919) % (largest - MIN_SIZE)


@cache
def _random_block() -> bytes:
    return pattern(0, 4 << 20)


def expected(index: int, largest: int) -> bytes:
    size = object_size(index, largest)
    offset = (index * 104_729) % ((4 << 20) - size)
    return index.to_bytes(8, "big") + _random_block()[offset + 8 : offset + size]


def report(what: str, count: int) -> None:
    # One write(2) per line: a kill can never leave half a line in the pipe, which
    # print() with several arguments can when stdout is unbuffered (PYTHONUNBUFFERED).
    os.write(sys.stdout.fileno(), f"{what} {count}\n".encode())


def storm(adapter: Any, largest: int, take: Any = None) -> None:
    """Store and delete until killed; ``take(data)`` gives the buffer to store from."""
    blocking = client(adapter)
    index = oldest = 0
    while True:
        if index - oldest >= LIVE:
            if adapter.delete(make_keys(BATCH, start=oldest)) != [True] * BATCH:
                raise SystemExit(f"delete of batch at {oldest} failed")
            oldest += BATCH
            report("deleted", oldest)
        data = [expected(i, largest) for i in range(index, index + BATCH)]
        views = [take(d) if take else memoryview(bytearray(d)) for d in data]
        if blocking.store(make_keys(BATCH, start=index), views) != [True] * BATCH:
            raise SystemExit(f"store of batch at {index} failed")
        index += BATCH
        report("stored", index)


def acknowledged_live(deleted: int, stored: int) -> range:
    """The objects whose store was acknowledged and whose delete had not begun, given the
    counts last reported: a delete is reported only once it returned, so the batch after
    the last one reported may have been deleted already when the writer is storing at
    :data:`LIVE` objects."""
    first = deleted + BATCH if stored - deleted >= LIVE else deleted
    return range(min(first, stored), stored)


# Generous: how long a writer may take to report the objects run_and_kill waits for.
REPORTS_DEADLINE_S = 120.0


def run_and_kill(writer: Path, path: str, at_least: int, extra_delay_s: float) -> tuple[int, int]:
    """Run ``writer PATH``, SIGKILL it once it stored ``at_least`` objects (plus a delay,
    to land inside a later batch); (deleted below, stored below) as last reported."""
    here = str(Path(__file__).parent)
    process = subprocess.Popen(
        [sys.executable, str(writer), path],
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(writer.parent), here, os.environ.get("PYTHONPATH", "")]),
        },
    )
    reported = {"stored": 0, "deleted": 0}

    def take(line: str) -> None:
        what, count = line.split()
        reported[what] = int(count)

    # A writer that stops reporting would leave the readline below blocked for good: killed
    # then, its pipe ends and the test fails saying so.
    stalled = threading.Event()
    watchdog = threading.Timer(REPORTS_DEADLINE_S, lambda: (stalled.set(), process.kill()))
    watchdog.daemon = True
    watchdog.start()
    try:
        assert process.stdout is not None
        while reported["stored"] < at_least:
            line = process.stdout.readline()
            assert not stalled.is_set(), (
                f"writer stored {reported['stored']} of {at_least} in {REPORTS_DEADLINE_S:g} s"
            )
            assert line, f"writer exited early with code {process.wait()}"
            take(line)
        watchdog.cancel()
        time.sleep(extra_delay_s)
        process.send_signal(signal.SIGKILL)
        for line in process.stdout:  # what it printed before dying had returned
            take(line)
    finally:
        watchdog.cancel()
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL
    return reported["deleted"], reported["stored"]
