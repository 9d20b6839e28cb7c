"""The signals that end a serving process besides SIGINT/SIGTERM, and what a stop leaves.

A hangup (the terminal or ssh session that started ``serve`` went away) and SIGQUIT
(Ctrl-\\) would, under their default actions, end the process on the spot: the L1 segment
stays in /dev/shm, the ipc socket file stays behind, and the acknowledged stores still
queued for L2 are lost without a count or a log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from thirdparty import CLI, free_port
from tiers_e2e import (
    LAUNCHER,
    ServerProcess,
    make_keys,
    make_payloads,
    slow_l2_server,
    start_server,
    stop_signals_at_default,
)

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import EXIT_ACKNOWLEDGED_WRITES_LOST


def _slow_l2_on_ipc(tmp_path: Path, name: str) -> ServerProcess:
    """A server on an ipc socket holding 3 stores for a slow L2, with a 1 s flush."""
    return slow_l2_server(tmp_path / name, host=f"ipc://{tmp_path / name}.sock", shutdown_timeout_s=1.0)


def _stopped(server: ServerProcess, *signals: int) -> tuple[int, str]:
    """Send ``signals`` in turn, then wait for the exit: its code and the server's output."""
    try:
        for sig in signals:
            server.proc.send_signal(sig)
        code = server.proc.wait(45)
    finally:
        server.stop(signal.SIGKILL)
    return code, server.output()


def test_a_hangup_stops_gracefully_and_counts_what_l2_did_not_get(tmp_path: Path) -> None:
    server = _slow_l2_on_ipc(tmp_path, "hup")
    code, output = _stopped(server, signal.SIGHUP)
    assert code == EXIT_ACKNOWLEDGED_WRITES_LOST, output
    assert "stopping on SIGHUP" in output
    assert "flush timed out after 1s: 3 L2 stores not waited for" in output
    assert "12 objects acknowledged to clients were not stored in L2 before the stop" in output
    assert not server.shm_path.exists(), "the L1 segment outlived a hangup"
    assert not (tmp_path / "hup.sock").exists(), "the ipc socket outlived a hangup"


def test_sigquit_stops_at_once_and_counts_what_l2_did_not_get(tmp_path: Path) -> None:
    server = _slow_l2_on_ipc(tmp_path, "quit")
    code, output = _stopped(server, signal.SIGQUIT)
    assert code == EXIT_ACKNOWLEDGED_WRITES_LOST, output
    assert "stopping at once on SIGQUIT" in output
    assert "flush abandoned on a second signal" not in output
    assert "flush abandoned on SIGQUIT: 3 L2 stores not waited for" in output
    assert "12 objects acknowledged to clients were not stored in L2 before the stop" in output
    assert not server.shm_path.exists(), "the L1 segment outlived SIGQUIT"
    assert not (tmp_path / "quit.sock").exists(), "the ipc socket outlived SIGQUIT"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_restart_on_the_same_names_serves_at_once(tmp_path: Path, sig: int) -> None:
    root = tmp_path / "l2"
    settings = {"host": f"ipc://{tmp_path / 'same.sock'}", "metrics": False}
    first = start_server(tmp_path / "first", adapters=[{"type": "fs", "path": str(root)}], **settings)
    keys = make_keys("restart", 4)
    with Client(first.url) as client:
        assert client.store(keys, make_payloads("restart", 4, 64 << 10)) == 4
    assert first.stop(sig) == 0, first.output()
    second = start_server(
        tmp_path / "second",
        adapters=[{"type": "fs", "path": str(root)}],
        l1_shm_name=first.shm_name,
        **settings,
    )
    try:
        with Client(second.url) as client:
            deadline = time.monotonic() + 30
            while client.lookup(keys) < 4:  # the fs L2 kept every acknowledged store
                assert time.monotonic() < deadline, second.output()
                time.sleep(0.05)
    finally:
        assert second.stop() == 0, second.output()


def test_a_hangup_whose_terminal_went_away_stops_with_code_0(tmp_path: Path) -> None:
    # The usual hangup: the terminal serve printed to is gone, so the stop summary it
    # prints last cannot be written (EIO).  The stop is done by then: that is no failure,
    # and what runs after the summary (leaving past threads stuck in calls) must still run.
    primary, terminal = pty.openpty()
    shm_name = f"tiers_test_{uuid.uuid4().hex[:12]}"
    settings = {"l1_size_gb": 0.25, "host": f"ipc://{tmp_path / 'gone.sock'}", "metrics_port": 0}
    spec = json.dumps({"config": {**settings, "l1_shm_name": shm_name}})
    ready, errors = tmp_path / "ready", tmp_path / "stderr.txt"
    with errors.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(LAUNCHER), spec, str(ready)],
            stdout=terminal,
            stderr=stderr,
            env={**os.environ, "LMCACHE_LOG_LEVEL": "INFO"},
            preexec_fn=stop_signals_at_default(),
        )
    os.close(terminal)
    os.set_blocking(primary, False)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, errors.read_text()
            with contextlib.suppress(BlockingIOError):
                os.read(primary, 1 << 16)  # the banner, read as a terminal would
            time.sleep(0.02)
        os.close(primary)  # the terminal goes away
        primary = -1
        proc.send_signal(signal.SIGHUP)
        code = proc.wait(45)
    finally:
        if primary >= 0:
            os.close(primary)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        (Path("/dev/shm") / shm_name).unlink(missing_ok=True)
    output = errors.read_text()
    assert code == 0, output
    assert "stopping on SIGHUP" in output
    assert "Traceback" not in output, output


def _stopped_by_sigterm_despite(tmp_path: Path, ignored: signal.Signals) -> str:
    """Start serve with ``ignored`` inherited as ignored, send it and then SIGTERM: SIGTERM
    alone must stop it, with code 0.  Returns the server's output."""
    server = start_server(
        tmp_path / ignored.name,
        host=f"ipc://{tmp_path / ignored.name}.sock",
        metrics=False,
        ignored_signals={ignored},
    )
    code, output = _stopped(server, ignored, signal.SIGTERM)
    assert code == 0, output
    assert "stopping on SIGTERM" in output
    assert f"stopping on {ignored.name}" not in output
    return output


def test_a_hangup_ignored_by_whoever_started_serve_stays_ignored(tmp_path: Path) -> None:
    # ``nohup serve`` starts it with SIGHUP ignored so that it outlives the terminal: a
    # hangup must then not stop it.  The SIGTERM sent after it is what stops it.
    output = _stopped_by_sigterm_despite(tmp_path, signal.SIGHUP)
    assert "stop signals ignored as inherited: SIGHUP (started under nohup" in output, output


def test_ctrl_c_ignored_by_the_script_that_started_serve_stays_ignored(tmp_path: Path) -> None:
    # ``serve &`` in a non-interactive script starts it with SIGINT ignored: the Ctrl-C meant
    # for the script's foreground command must not stop it.  SIGTERM still does, and the
    # start-up log says which stop signals stay ignored.
    output = _stopped_by_sigterm_despite(tmp_path, signal.SIGINT)
    assert "stop signals ignored as inherited: SIGINT" in output, output


def test_a_start_refused_under_inherited_ignored_signals_is_still_one_line() -> None:
    # The line naming the stop signals inherited ignored came before the pre-flight's
    # refusal, so a serve started under nohup or as a script's background job answered a
    # bad setting with two lines instead of the one line every refusal is.
    ignored = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
    args = ["serve", "--no-default-l2", "--l1-size-gb", "100000", "--metrics-port", "0"]
    result = subprocess.run(
        [*CLI, *args, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMCACHE_LOG_LEVEL": "INFO"},
        preexec_fn=stop_signals_at_default(ignored),
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --l1-size-gb 100000: "), result.stderr
