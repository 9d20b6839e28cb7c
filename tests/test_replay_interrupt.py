"""A replay through a server that is interrupted mid-request leaves no read locks behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from replay_helpers import BLOCK_BYTES, output_of_killed, small_trace, start_block_server

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.replay.run import ReplayOptions, ReplayTotals
from lmcache_tiers.replay.server import replay_share
from lmcache_tiers.replay.trace import read_trace


def _interrupt_after_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C arriving right after a LOOKUP answered with hits, before the RETRIEVE."""
    counted = ReplayTotals.count_request

    def count_then_interrupt(self: ReplayTotals, request: object, hits: int) -> None:
        counted(self, request, hits)  # type: ignore[arg-type]
        if hits:
            raise KeyboardInterrupt

    monkeypatch.setattr(ReplayTotals, "count_request", count_then_interrupt)


def _replay_twice(url: str, tmp_path: Path) -> Callable[[], object]:
    """Replay a small trace through ``url`` once, filling its L1; returns the replay of the
    same trace again, which finds hits."""
    trace = read_trace(small_trace(tmp_path / "t.jsonl", requests=20))
    requests = list(enumerate(trace.requests))
    options = ReplayOptions(block_bytes=BLOCK_BYTES, timeout_s=10.0)
    origin = trace.requests[0].timestamp_ms

    def replay() -> object:
        return replay_share(url, requests, options, origin_ms=origin, start=time.monotonic())

    replay()
    return replay


def _interrupted_replay_leaves_no_locks(tmp_path: Path, interrupt: Callable[[], None]) -> None:
    """Replay a trace twice through a new server, the second time with ``interrupt()``
    installed first (it patches in a KeyboardInterrupt), and check no read lock is left."""
    server = start_block_server(tmp_path / "server", 500)
    try:
        replay_twice = _replay_twice(server.url, tmp_path)
        interrupt()
        with pytest.raises(KeyboardInterrupt):
            replay_twice()
        with Client(server.url, timeout=10.0) as probe:
            assert probe.status()["server"]["locked_keys"] == 0
    finally:
        assert server.stop() == 0, server.output()


def test_an_interrupt_between_lookup_and_retrieve_gives_the_locks_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The LOOKUP read-locks the hit prefix for this client; left behind, those objects
    # stay pinned (unevictable) until the server's lock TTL, long after the replay ended.
    _interrupted_replay_leaves_no_locks(tmp_path, lambda: _interrupt_after_a_hit(monkeypatch))


def test_an_interrupt_as_a_lookup_answers_gives_the_locks_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C or SIGTERM landing once the LOOKUP's reply has come (its hit prefix
    read-locked for this client) but before ``lookup`` returned the hits: the replay did not
    know of the locks and left them to the server's lock TTL."""
    looked_up = Client.lookup

    def lookup_then_interrupt(self: Client, keys: list[ObjectKey], timeout: float | None = None) -> int:
        if looked_up(self, keys, timeout):
            raise KeyboardInterrupt
        return 0

    _interrupted_replay_leaves_no_locks(
        tmp_path, lambda: monkeypatch.setattr(Client, "lookup", lookup_then_interrupt)
    )


# Run as the replay's main script: its top level runs again in every client process
# (multiprocessing's spawn imports the main script there), so each client holds on.
_HOLDING_REPLAY = """
import os, sys, time
from pathlib import Path

from lmcache_tiers.replay.run import ReplayTotals

_counted = ReplayTotals.count_request
_HELD = Path(os.environ["REPLAY_HELD_DIR"])  # argv is not passed on to the clients


def _count_then_hold(self, request, hits):
    _counted(self, request, hits)
    if hits:  # the LOOKUP read-locked the hit prefix; the RETRIEVE has not taken it over
        (_HELD / str(os.getpid())).touch()
        while True:
            time.sleep(0.05)


ReplayTotals.count_request = _count_then_hold

if __name__ == "__main__":
    from lmcache_tiers.cli.main import main

    sys.argv = ["lmcache-tiers", *sys.argv[1:]]
    main()
"""


@pytest.mark.parametrize("clients", [1, 2])
def test_a_server_replay_stopped_by_sigterm_gives_its_read_locks_back(tmp_path: Path, clients: int) -> None:
    """SIGTERM (a supervisor, ``timeout``) ended the replay and its client processes at
    once: the blocks their last LOOKUP found stayed read-locked, pinned in the server's L1
    until the lock TTL (300 s by default)."""
    server = start_block_server(tmp_path / "server", 500)
    held = tmp_path / "held"
    held.mkdir()
    script = tmp_path / "holding_replay.py"
    script.write_text(_HOLDING_REPLAY)
    try:
        trace_path = small_trace(tmp_path / "t.jsonl", requests=20)
        trace = read_trace(trace_path)
        options = ReplayOptions(block_bytes=BLOCK_BYTES, timeout_s=10.0)
        requests = list(enumerate(trace.requests))
        origin = trace.requests[0].timestamp_ms
        replay_share(server.url, requests, options, origin_ms=origin, start=time.monotonic())  # fills L1
        args = ["replay", str(trace_path), "--url", server.url, "--block-bytes", str(BLOCK_BYTES)]
        replay = subprocess.Popen(
            [sys.executable, str(script), *args, "--clients", str(clients), "--json"],
            env=dict(os.environ, REPLAY_HELD_DIR=str(held)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while len(list(held.iterdir())) < clients:
                assert replay.poll() is None, replay.communicate()
                assert time.monotonic() < deadline, (
                    f"the clients never all held their keys: {output_of_killed(replay)}"
                )
                time.sleep(0.05)
            with Client(server.url, timeout=10.0) as probe:
                assert probe.status()["server"]["locked_keys"] > 0  # what the replay must give back
            replay.send_signal(signal.SIGTERM)
            out, err = replay.communicate(timeout=60)
        finally:
            replay.kill()
        assert replay.returncode == 128 + signal.SIGTERM, err
        assert "Traceback" not in err, err
        assert json.loads(out)["stopped"].startswith("interrupted (SIGTERM) after "), out  # a partial report
        for pid in held.iterdir():
            assert not psutil.pid_exists(int(pid.name)), f"client process {pid.name} outlived the replay"
        with Client(server.url, timeout=10.0) as probe:
            assert probe.status()["server"]["locked_keys"] == 0
    finally:
        assert server.stop() == 0, server.output()


# Run as the replay's main script: SIGTERM (a supervisor) at the first request, then Ctrl-C
# while the StorageManager closes.
_INTERRUPTED_CLOSE_REPLAY = """
import signal, sys

from lmcache_tiers.replay.run import ReplayTotals
from lmcache_tiers.storage import StorageManager

_counted, _close = ReplayTotals.count_request, StorageManager.close


def _count_then_terminate(self, request, hits):
    _counted(self, request, hits)
    signal.raise_signal(signal.SIGTERM)


def _interrupted_close(self, *args, **kwargs):
    signal.raise_signal(signal.SIGINT)  # a second signal, in the clean-up of the first
    _close(self, *args, **kwargs)


ReplayTotals.count_request = _count_then_terminate
StorageManager.close = _interrupted_close

if __name__ == "__main__":
    from lmcache_tiers.cli.main import main

    sys.argv = ["lmcache-tiers", *sys.argv[1:]]
    main()
"""


def test_a_second_signal_does_not_cut_an_in_process_replays_clean_up_short(tmp_path: Path) -> None:
    """An in-process replay ignored only a second SIGTERM: Ctrl-C while a SIGTERM closed the
    StorageManager cut the close short, leaving the L1 arena in /dev/shm, and exited 130.
    Every replay now ignores all signals after the first."""
    trace = str(small_trace(tmp_path / "t.jsonl", requests=20))
    name = f"replay_second_{tmp_path.name[-12:]}"
    config = tmp_path / "tiers.toml"
    config.write_text(f'l1_shm_name = "{name}"\n')
    segment = Path("/dev/shm") / name
    script = tmp_path / "interrupted_close_replay.py"
    script.write_text(_INTERRUPTED_CLOSE_REPLAY)
    args = ["replay", trace, "--in-process", "--l1-blocks", "50", "--block-bytes", str(BLOCK_BYTES)]
    try:
        replay = subprocess.run(
            [sys.executable, str(script), *args, "--config", str(config), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert replay.returncode == 128 + signal.SIGTERM, replay.stderr
        assert "Traceback" not in replay.stderr, replay.stderr
        # the report of the one request replayed, said to be partial
        assert json.loads(replay.stdout)["stopped"] == "interrupted (SIGTERM) after 1 of 20 requests"
        assert not segment.exists(), "the L1 segment outlived the replay"
    finally:
        segment.unlink(missing_ok=True)
