"""A process SIGKILLed during a store storm on a dax mapping: after reopening, every hit
returns the stored bytes, every acknowledged store is there and no deleted object is back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dax_crash_writer import BATCH, crash_config, expected, object_size
from dax_helpers import client, open_dax, shm_dir

from lmcache_tiers.testing.l2 import make_keys

WRITER = Path(__file__).with_name("dax_crash_writer.py")


def run_and_kill(path: str, at_least: int, extra_delay_s: float) -> tuple[int, int]:
    """(deleted below, stored below) as last reported by the killed writer."""
    writer = subprocess.Popen(
        [sys.executable, str(WRITER), path],
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(WRITER.parent), os.environ.get("PYTHONPATH", "")]),
        },
    )
    reported = {"stored": 0, "deleted": 0}
    try:
        assert writer.stdout is not None
        while reported["stored"] < at_least:
            line = writer.stdout.readline()
            assert line, f"writer exited early with code {writer.wait()}"
            what, count = line.split()
            reported[what] = int(count)
        time.sleep(extra_delay_s)
        writer.send_signal(signal.SIGKILL)
        for line in writer.stdout:
            what, count = line.split()
            reported[what] = int(count)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    return reported["deleted"], reported["stored"]


@pytest.mark.parametrize("delay_s", [0.0, 0.7, 1.9])
def test_sigkill_during_store_storm_then_reopen(delay_s: float) -> None:
    with shm_dir() as directory:
        path = str(directory / "dax.img")
        deleted, stored = run_and_kill(path, 160, delay_s)
        adapter = open_dax(crash_config(path))
        try:
            print(f"killed after storing {stored} and deleting {deleted}; {adapter.stats()}")
            # The delete after the last one reported may have been under way.
            must_be_gone = make_keys(deleted, start=0)[-512:]
            for start in range(0, len(must_be_gone), 64):
                batch = must_be_gone[start : start + 64]
                assert client(adapter).lookup_and_lock(batch).found == [False] * len(batch), (
                    "a deleted object came back"
                )
            keys = make_keys(stored + BATCH - deleted, start=deleted)
            result = client(adapter).lookup_and_lock(keys)
            indexes = [deleted + i for i, hit in enumerate(result.found) if hit]
            found = [key for key, hit in zip(keys, result.found, strict=True) if hit]
            buffers = [memoryview(bytearray(object_size(i))) for i in indexes]
            loaded = client(adapter).load(found, buffers)
            adapter.unlock(found)
            for index, ok, buffer in zip(indexes, loaded, buffers, strict=True):
                assert ok and bytes(buffer) == expected(index), f"object {index} loaded wrong or not at all"
            acknowledged = set(range(min(deleted + BATCH, stored), stored))
            assert acknowledged <= set(indexes), "an acknowledged store is missing"
            assert adapter.stats().get("corrupt_records_removed", 0) == 0
        finally:
            adapter.close()
