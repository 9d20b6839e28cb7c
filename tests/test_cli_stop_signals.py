"""The entry point's stop-signal handling (``cli.stop_signals``) never leaves a process
that a stop signal cannot end: not after a first signal was swallowed on its way out, and
not once a command's own handling has taken over.

Each test holds the command at a known point by wrapping a function in the command's
process: the wrapper creates a file, then waits there for the test's signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from thirdparty import stop_signals_at_default

#: how long a held process waits for a signal the test sends at once: only a process
#: that ignores it waits this out (and then ends on its own, failing the test)
HOLD_S = 60.0

#: ``plugins list`` with the plugins' loading wrapped: a first stop signal is swallowed
#: there (as a plugin's ``except BaseException`` would), which creates MARKER; the
#: command then waits for a second one
_SWALLOWED = """
import pathlib, sys, time
marker, hold_s = sys.argv[1], float(sys.argv[2])
del sys.argv[1:3]
import lmcache_tiers.plugins as plugins

original = plugins.load_plugins

def swallowing():
    try:
        pathlib.Path(marker + ".held").touch()
        while True:
            time.sleep(3600)
    except BaseException:
        pathlib.Path(marker).touch()
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return original()

plugins.load_plugins = swallowing
from lmcache_tiers.cli.main import main
sys.argv[0] = "lmcache-tiers"
main(["plugins", "list"])
"""


def _wait_for(marker: Path, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the command never got there"
        time.sleep(0.02)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_after_a_swallowed_one_still_ends_the_command(tmp_path: Path, second: int) -> None:
    """The first SIGTERM put both signals to SIG_IGN before raising: swallowed on its way
    out, it left the command running deaf to SIGTERM and Ctrl-C."""
    marker = tmp_path / "swallowed"
    process = subprocess.Popen(
        [sys.executable, "-c", _SWALLOWED, str(marker), str(HOLD_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=stop_signals_at_default(),
    )
    try:
        _wait_for(Path(f"{marker}.held"), process)
        process.send_signal(signal.SIGTERM)
        _wait_for(marker, process)
        process.send_signal(second)
        _out, err = process.communicate(timeout=HOLD_S * 2)
    finally:
        process.kill()
    assert process.returncode == -second, err
