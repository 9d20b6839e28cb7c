"""A forced stop that a stuck plugin holds up still ends serve, without leaving its files.

The plugin is an L1 eviction policy whose ``victims`` hook never returns: it holds L1's
lock, so the stop's close, which needs that lock, waits for good on the main thread --
the only thread Python runs signal handlers on.  Before, no further signal ended the
process and SIGKILL left the L1 segment in /dev/shm.  Each test installs the policy as
a one-file plugin (a dist-info with its entry point, put on PYTHONPATH), serves on an ipc
socket, stores until the hook is stuck, then signals.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_plugin_guide_refusals import CLI, install_flat_plugin

from lmcache_tiers.client import Client
from lmcache_tiers.client.errors import ClientError
from lmcache_tiers.keys import ObjectKey

#: the environment variable naming the file the stuck hook creates as it gets stuck
STUCK_MARK_ENV = "TIERS_TEST_STUCK_MARK"
#: the environment variable that shortens a graceful stop's close window in the server
CLOSE_WINDOW_ENV = "TIERS_TEST_GRACEFUL_CLOSE_WINDOW_S"

#: the front ends' join grace of the graceful stop's server
_SHORT_JOIN_GRACE_S = 1.0

STUCK_POLICY = f"""
import os
import time
from pathlib import Path

from lmcache_tiers.plugin import ComponentConfig, hookimpl


class StuckPolicy:
    def __init__(self, config):
        self.keys = []

    def on_keys_written(self, keys):
        self.keys.extend(keys)

    def on_keys_read(self, keys):
        pass

    def on_keys_removed(self, keys):
        pass

    def victims(self):
        Path(os.environ["{STUCK_MARK_ENV}"]).touch()
        time.sleep(3600)  # a hook that never returns, called with L1's lock held
        return iter(self.keys)


@hookimpl
def tiers_register_eviction_policies(registry):
    registry.add("guide_stuck", StuckPolicy, ComponentConfig)


if os.environ.get("{CLOSE_WINDOW_ENV}"):
    # Loaded before serve starts its guard: a graceful stop is then ended after seconds,
    # not the half minute its close gets in production, and the window's share for the
    # front ends' join is 1 s, not 5 (the test reads the window the guard was given from
    # its error line, so a rename here fails it).
    from lmcache_tiers.server import app, stuck_stop

    stuck_stop.GRACEFUL_CLOSE_WINDOW_S = float(os.environ["{CLOSE_WINDOW_ENV}"])
    app._JOIN_GRACE_S = {_SHORT_JOIN_GRACE_S}
"""

#: a generous guard against a test that would otherwise hang: not a measured time
_GUARD_S = 60.0


def _signals_at_default() -> None:
    """A test run in a script's background inherits SIGINT and SIGQUIT ignored, and one
    run under nohup SIGHUP; serve keeps them so, and the signal a test sends would then
    do nothing."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


class StuckServer:
    """``serve`` with the stuck policy for L1, on an ipc socket, its output in a file."""

    def __init__(self, tmp_path: Path, close_window_s: float | None = None) -> None:
        site = tmp_path / "site"
        install_flat_plugin(site, "guidestuck", STUCK_POLICY)
        self.socket = tmp_path / "stuck.sock"
        self.mark = tmp_path / "stuck"
        self.log = tmp_path / "serve.log"
        path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        environ = dict(os.environ, PYTHONPATH=path, LMCACHE_LOG_LEVEL="INFO")
        environ[STUCK_MARK_ENV] = str(self.mark)
        if close_window_s is not None:
            environ[CLOSE_WINDOW_ENV] = str(close_window_s)
        command = [
            *CLI,
            "serve",
            "--l1-size-gb",
            "0.03",
            "--no-default-l2",
            "--host",
            f"ipc://{self.socket}",
            "--metrics-port",
            "0",
            "--eviction-policy",
            "guide_stuck",
            "--shutdown-timeout",
            "1",
        ]
        with self.log.open("wb") as output:
            self.proc = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=environ, preexec_fn=_signals_at_default
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def segments(self) -> list[Path]:
        return sorted(Path("/dev/shm").glob(f"lmcache_tiers_{self.proc.pid}_*"))

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + _GUARD_S
        while text not in self.output():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.05)

    def store_until_stuck(self) -> None:
        """Store until L1 evicts: the policy's hook is then stuck, holding L1's lock."""
        self.wait_for("serving 0:native")
        payloads = [np.full(1 << 20, index, dtype=np.uint8) for index in range(4)]
        deadline = time.monotonic() + _GUARD_S
        with Client(f"ipc://{self.socket}", timeout=1.0, cleanup_timeout=1.0) as client:
            batch = 0
            while not self.mark.exists():
                assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
                keys = [ObjectKey("stuck", 0, _digest(f"{batch}/{i}"), 0, "") for i in range(4)]
                try:
                    client.store(keys, payloads)
                except ClientError:
                    pass  # the store that made L1 evict waits on the stuck hook
                batch += 1

    def stopped(self, first: signal.Signals, *then: signal.Signals) -> tuple[int, str]:
        """Send ``first``, and once the server says it stops, ``then`` back to back; the
        exit status and the output."""
        try:
            self.proc.send_signal(first)
            self.wait_for(f"on {first.name}")  # "stopping on SIGTERM", "stopping at once on SIGQUIT"
            for sig in then:
                self.proc.send_signal(sig)
            code = self.proc.wait(_GUARD_S)
        finally:
            self.kill()
        return code, self.output()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for segment in self.segments():  # what SIGKILL left behind
            segment.unlink(missing_ok=True)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


def _stuck_server(tmp_path: Path, close_window_s: float | None = None) -> StuckServer:
    server = StuckServer(tmp_path, close_window_s)
    try:
        server.store_until_stuck()
    except BaseException:
        server.kill()
        raise
    return server


@pytest.fixture
def stuck(tmp_path: Path) -> StuckServer:
    return _stuck_server(tmp_path)


def _ended_as_the_stop_failed(server: StuckServer, code: int, output: str, why: str) -> None:
    assert code == 1, output  # L1 only: no acknowledged write waited for L2
    ended = [line for line in output.splitlines() if "stopping at once: " in line]
    assert len(ended) == 1 and why in ended[0], output
    assert "removed the L1 segment, the ipc socket" in output, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert errors[0].startswith("error: the stop failed: ") and why in errors[0], output
    assert errors[0].endswith("; no L2, no acknowledged write waits for one"), output
    assert "Traceback" not in output, output
    assert server.segments() == [], "the L1 segment outlived the stop"
    assert not server.socket.exists(), "the ipc socket outlived the stop"


def test_a_second_signal_ends_a_stop_a_stuck_policy_holds_up(stuck: StuckServer) -> None:
    code, output = stuck.stopped(signal.SIGTERM, signal.SIGTERM)
    _ended_as_the_stop_failed(stuck, code, output, "the stop forced by a second signal did not finish")


def test_sigquit_ends_a_stop_a_stuck_policy_holds_up(stuck: StuckServer) -> None:
    code, output = stuck.stopped(signal.SIGQUIT)
    _ended_as_the_stop_failed(stuck, code, output, "the stop forced by SIGQUIT did not finish")


def test_a_third_signal_ends_the_forced_stop_without_waiting_for_it(stuck: StuckServer) -> None:
    # Two signals of one kind sent back to back may arrive as one (the kernel keeps one
    # pending of each): the second and third are of other kinds.
    code, output = stuck.stopped(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    _ended_as_the_stop_failed(
        stuck, code, output, "came while the stop forced by a second signal was still running"
    )


def test_a_graceful_stop_a_stuck_policy_holds_up_ends_past_its_deadlines(tmp_path: Path) -> None:
    # One SIGTERM, as a supervisor sends, and no second one: the drain and the front ends'
    # join (1 s + 1 s here), the flush (1 s) and the close window (1 s here) all pass.
    server = _stuck_server(tmp_path, close_window_s=1.0)
    code, output = server.stopped(signal.SIGTERM)
    _ended_as_the_stop_failed(
        server, code, output, "the stop begun by SIGTERM did not finish within 4s, its drain, flush and close"
    )
