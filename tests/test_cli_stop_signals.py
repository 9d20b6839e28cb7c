"""The entry point's stop-signal handling (``cli.stop_signals``) never leaves a process
that a stop signal cannot end: not after a first signal was swallowed on its way out, and
not once a command's own handling has taken over.

Each test holds the command at a known point by wrapping a function in the command's
process: the wrapper creates a file, then waits there for the test's signal."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from thirdparty import CLI, free_port, launch_script
from tiers_e2e import stop_signals_at_default

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
            time.sleep(0.05)  # short: a signal landing just before one starts waits for its end
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
    process = launch_script(_SWALLOWED, str(marker), str(HOLD_S))
    try:
        _wait_for(Path(f"{marker}.held"), process)
        process.send_signal(signal.SIGTERM)
        _wait_for(marker, process)
        process.send_signal(second)
        _out, err = process.communicate(timeout=HOLD_S * 2)
    finally:
        process.kill()
    assert process.returncode == -second, err


#: ``serve`` on an ipc socket whose server stops itself once ready (SIGTERM to its own
#: process) with exit code 3, then leaves a thread stuck in a call behind: leaving the
#: process, it creates MARKER and lingers for that thread
_STOPPED_SERVE = """
import os, pathlib, signal, sys, threading
marker = sys.argv[1]
del sys.argv[1]
import lmcache_tiers.server.app as app
import lmcache_tiers.server.leave as leave

run_server, leave_past_stuck_threads = app.run_server, leave.leave_past_stuck_threads

def stopping_once_ready(config, **kwargs):
    ready = threading.Event()

    def stop():
        ready.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()
    assert run_server(config, **{**kwargs, "ready": ready}) == 0
    return 3  # a stop's code that no signal's default action gives: acknowledged writes lost

def lingering(code, linger_s=leave.LINGER_S):
    threading.Thread(target=threading.Event().wait, name="stuck-in-a-call").start()
    pathlib.Path(marker).touch()
    leave_past_stuck_threads(code, linger_s=3600)

app.run_server, leave.leave_past_stuck_threads = stopping_once_ready, lingering
from lmcache_tiers.cli.main import main
sys.argv[0] = "lmcache-tiers"
main(sys.argv[1:])
"""


#: ``serve`` as above, the two threads it leaves behind blocked for good reading a FIFO
#: nobody writes; the first one's join creates MARKER, so a signal then comes while the
#: process lingers for them.  Two, because Python (3.11) takes a thread whose join a
#: KeyboardInterrupt cut short for stopped, and its exit then waits only for the others.
_STOPPED_SERVE_STUCK_ON_A_FIFO = _STOPPED_SERVE.replace(
    """    threading.Thread(target=threading.Event().wait, name="stuck-in-a-call").start()
    pathlib.Path(marker).touch()
""",
    """    fifo = marker + ".fifo"
    os.mkfifo(fifo)

    class Reading(threading.Thread):
        def join(self, timeout=None):
            pathlib.Path(marker).touch()
            super().join(timeout)

    def read():
        with open(fifo, "rb") as stuck:  # no writer ever opens it
            stuck.read()

    Reading(target=read, name="fifo-read-1").start()
    Reading(target=read, name="fifo-read-2").start()
""",
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_as_serve_lingers_for_stuck_threads_ends_it_with_the_stops_code(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """A Ctrl-C while the process lingered for threads stuck in calls raised
    KeyboardInterrupt there, past the exit that leaves them behind: the process printed
    "stopped by SIGINT" and then hung in Python's exit, joining threads stuck for good,
    until a second Ctrl-C.  A SIGTERM there, left to its default action, ended the process
    by the signal (exit -15), so the stop's code (3: acknowledged writes lost) never
    reached whoever stopped it.  Either now leaves at once with the stop's exit code."""
    assert "Reading(target=read" in _STOPPED_SERVE_STUCK_ON_A_FIFO  # the replacement took
    marker = tmp_path / "lingering"
    args = ["serve", "--no-default-l2", "--l1-size-gb", "0.01", "--disable-metrics"]
    args += ["--host", f"ipc://{tmp_path / 'rpc.sock'}"]
    process = launch_script(_STOPPED_SERVE_STUCK_ON_A_FIFO, str(marker), *args)
    try:
        _wait_for(marker, process)
        process.send_signal(sig)
        try:
            _out, err = process.communicate(timeout=HOLD_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve went on waiting for the stuck threads after {sig.name}")
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 3, err
    last = err.strip().splitlines()[-1]  # the signal's one line, nothing after it
    assert last.endswith(
        f"WARNING lmcache_tiers.server: {sig.name} while waiting for 2 threads still in calls after the stop"
        " (fifo-read-1, fifo-read-2): exiting without waiting for them"
    ), err
    assert "stopped by" not in err and "as the command started" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_a_client_command_at_work_says_it_stopped_it(tmp_path: Path, sig: int) -> None:
    """status and bench have no stop handling of their own: a SIGTERM while they waited
    for a server (their note printed, long after start-up) ended them with exit 143 and a
    line saying it came "as the command started"; a Ctrl-C there ended them with exit 130
    and only a blank line, typer having turned the KeyboardInterrupt into a silent exit."""
    url = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: each waits out --timeout
    commands = {
        "status": ["status", "--url", url, "--timeout", "300", "--json"],
        "bench": ["bench", "--url", url, "--timeout", "300", "--chunks", "2", "--json"],
    }
    running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for name, args in commands.items():
            err_path = tmp_path / f"{name}.err"
            with err_path.open("wb") as err:
                process = subprocess.Popen(
                    [*CLI, *args],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    preexec_fn=stop_signals_at_default(),
                )
            running[name] = process, err_path
        for name, (process, err_path) in running.items():
            deadline = time.monotonic() + 120
            while "note: no answer from" not in err_path.read_text():
                assert process.poll() is None, (name, err_path.read_text())
                assert time.monotonic() < deadline, (name, "never waited for the server")
                time.sleep(0.05)
            process.send_signal(sig)
        for name, (process, err_path) in running.items():
            code = process.wait(HOLD_S)
            lines = [line for line in err_path.read_text().splitlines() if line.strip()]
            assert code == 128 + sig, (name, lines)
            assert lines[0].startswith("note: no answer from"), (name, lines)
            assert lines[1:] == [f"error: stopped by {signal.Signals(sig).name}"], (name, lines)
    finally:
        for process, _err_path in running.values():
            process.kill()
            process.wait()
