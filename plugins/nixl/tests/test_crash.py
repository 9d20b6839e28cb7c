"""A process SIGKILLed in the middle of a store storm leaves nothing a restart would serve wrong."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from crash_writer import expected, object_size
from nixl_helpers import Arena, client, dynamic_config, open_dynamic, scratch_dir

from lmcache_tiers.plugin import is_temp_name
from lmcache_tiers.testing.l2 import make_keys

WRITER = Path(__file__).with_name("crash_writer.py")
# Generous: how long the writer may take to report its objects, or to begin a batch.
WRITER_DEADLINE_S = 120.0


def temp_files(root: str) -> list[str]:
    return [name for _dir, _dirs, files in os.walk(root) for name in files if is_temp_name(name)]


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct_io"])
def test_sigkill_during_store_storm_then_restart(direct_io: bool) -> None:
    """With ``use_direct_io`` too: payloads and headers then reach the files through
    O_DIRECT requests, and a kill may land between them."""
    with scratch_dir() as root:
        writer = subprocess.Popen(
            [sys.executable, str(WRITER), root, *(["direct"] if direct_io else [])],
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(WRITER.parent), os.environ.get("PYTHONPATH", "")]),
            },
        )
        # A writer that stops reporting would leave the readline below blocked for good:
        # killed then, its pipe ends and the test fails saying so.
        stalled = threading.Event()
        watchdog = threading.Timer(WRITER_DEADLINE_S, lambda: (stalled.set(), writer.kill()))
        watchdog.daemon = True
        watchdog.start()
        try:
            assert writer.stdout is not None
            # Let it publish a few hundred objects, then kill it while a batch is being
            # written: as soon as a temporary file shows up in the directory its keys use
            # (make_keys' hashes start with 0000).
            stored = 0
            while stored < 320:
                line = writer.stdout.readline()
                assert not stalled.is_set(), (
                    f"writer reported {stored} of 320 objects in {WRITER_DEADLINE_S:g} s"
                )
                assert line, f"writer exited early with code {writer.wait()}"
                stored = int(line)
            watchdog.cancel()
            shard = os.path.join(root, "00", "00")
            deadline = time.monotonic() + WRITER_DEADLINE_S
            # A busy poll: a temporary file lives only while its batch is being written.
            while writer.poll() is None and not any(is_temp_name(name) for name in os.listdir(shard)):
                assert time.monotonic() < deadline, f"no temporary file showed up in {shard}"
            writer.send_signal(signal.SIGKILL)
        finally:
            watchdog.cancel()
            writer.kill()
            writer.wait()
        assert writer.returncode == -signal.SIGKILL
        left_behind = len(temp_files(root))
        print(f"killed after {stored} objects reported, {left_behind} temporary files left behind")

        arena = Arena(64 << 20)
        config = dynamic_config(root, capacity_gb=64, shard_dirs=True, direct_io=direct_io)
        adapter = open_dynamic(config, arena.view)
        try:
            assert temp_files(root) == [], "start-up must remove the killed writer's temporary files"
            assert adapter.stats().get("orphan_temp_files_removed", 0) == left_behind
            # Objects past the last reported batch may or may not have been published.
            candidates = stored + 64
            keys = make_keys(candidates)
            hits = 0
            for start in range(0, candidates, 16):
                batch = keys[start : start + 16]
                result = client(adapter).lookup_and_lock(batch)
                found = [key for key, hit in zip(batch, result.found, strict=True) if hit]
                indexes = [start + i for i, hit in enumerate(result.found) if hit]
                assert all(
                    result.sizes[i] == object_size(start + i) for i, hit in enumerate(result.found) if hit
                )
                buffers = [arena.take(object_size(i)) for i in indexes]
                loaded = client(adapter).load(found, buffers)
                adapter.unlock(found)
                for index, ok, buffer in zip(indexes, loaded, buffers, strict=True):
                    assert ok, f"object {index} was found but did not load"
                    assert bytes(buffer) == expected(index), f"object {index} loaded wrong bytes"
                hits += len(found)
                arena = Arena(64 << 20) if start % 128 == 112 else arena
            assert hits >= stored, "every object the writer reported stored must survive"
        finally:
            adapter.close()
