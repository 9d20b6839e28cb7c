"""``lmcache-tiers replay`` stopped by SIGTERM or Ctrl-C before or after the replay proper
(reading the trace, simulating, pre-faulting an in-process L1): one line naming the signal
and what was cut short, exit 128 + the signal, nothing left in /dev/shm.

The test sends the signal once the replay is known to be in that step: a trace that is a
named pipe the test holds open, or a hook, run in the replay's process, that says (by
creating a file) that the step has begun and then waits there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from replay_helpers import BLOCK_BYTES, output_of_killed, small_trace, start_block_server
from thirdparty import launch_cli, launch_script

from lmcache_tiers.client import Client

SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])

#: every signal serve stops on: before the command's handling is in place each is one line
#: (SIGHUP and SIGQUIT ended the process silently there, exit -1 and -3)
START_SIGNALS = pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT],
    ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"],
)

#: run in the replay's process before the command: MODULE's ATTRIBUTE (a dotted path in it)
#: is wrapped so that, once the wrapped call has run, the file MARKER is created and the
#: call waits
_HOOK = """
import importlib, pathlib, sys, time
module_name, attribute_path, marker = sys.argv[1:4]
del sys.argv[1:4]
owner = importlib.import_module(module_name)
*parents, attribute = attribute_path.split(".")
for parent in parents:
    owner = getattr(owner, parent)
original = getattr(owner, attribute)

def held(*args, **kwargs):
    result = original(*args, **kwargs)
    pathlib.Path(marker).touch()
    while True:
        # short sleeps: a signal landing just before one starts is handled only as
        # it ends
        time.sleep(0.05)  # until the test's signal
    return result

setattr(owner, attribute, held)
from lmcache_tiers.cli.main import main
sys.argv[0] = "lmcache-tiers"
main(sys.argv[1:])
"""


def _launch_held(module: str, attribute: str, marker: Path, args: list[str]) -> subprocess.Popen[str]:
    return launch_script(_HOOK, module, attribute, str(marker), *args)


#: run in the replay's process before the command: the import of MODULE creates the file
#: MARKER and waits
_HELD_IMPORT = """
import pathlib, sys, time
module_name, marker = sys.argv[1:3]
del sys.argv[1:3]

class Held:
    def find_spec(self, name, path, target=None):
        if name == module_name:
            pathlib.Path(marker).touch()
            while True:
                # short sleeps: a signal landing just before one starts is handled
                # only as it ends
                time.sleep(0.05)  # until the test's signal
        return None

sys.meta_path.insert(0, Held())
from lmcache_tiers.cli.main import main
sys.argv[0] = "lmcache-tiers"
main(sys.argv[1:])
"""


def _signal_once_held(replay: subprocess.Popen[str], marker: Path, sig: int) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of ``replay`` sent ``sig`` once it is held."""
    try:
        _wait_for(marker, replay)
        replay.send_signal(sig)
        out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
    return replay.returncode, out, err


def _wait_for(marker: Path, replay: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert replay.poll() is None, replay.communicate()
        assert time.monotonic() < deadline, f"the replay never got there: {output_of_killed(replay)}"
        time.sleep(0.02)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@SIGNALS
def test_a_signal_while_the_trace_is_read_is_one_line(tmp_path: Path, sig: int) -> None:
    """SIGTERM killed the command outright (no line, exit -15); Ctrl-C printed an empty line."""
    trace = tmp_path / "trace.jsonl"
    os.mkfifo(trace)
    replay = launch_cli(["replay", str(trace), "--simulate"])
    try:
        with open(trace, "w") as writer:  # returns once the replay has opened the trace
            writer.write(small_trace(tmp_path / "head.jsonl", 5).read_text())
            writer.flush()
            replay.send_signal(sig)  # the replay waits for the rest of the trace
            out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
    name = signal.Signals(sig).name
    assert replay.returncode == 128 + sig, err
    assert out == ""
    assert (
        _one_error_line(err)
        == f"error: interrupted ({name}) while reading the trace {trace}; nothing was replayed"
    )


@SIGNALS
def test_a_signal_during_the_simulation_is_one_line(tmp_path: Path, sig: int) -> None:
    """SIGTERM killed the command outright (no line, exit -15); Ctrl-C printed an empty line."""
    marker = tmp_path / "simulating"
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--simulate", "--json"]
    code, out, err = _signal_once_held(
        _launch_held("lmcache_tiers.replay.simulate", "simulate_curve", marker, args), marker, sig
    )
    assert code == 128 + sig, err
    assert out == ""
    assert _one_error_line(err) == (
        f"error: interrupted ({signal.Signals(sig).name}) while simulating; "
        "no report: the simulation was cut short"
    )


@SIGNALS
def test_a_signal_as_an_in_process_l1_is_pre_faulted_is_one_line_and_leaves_no_segment(
    tmp_path: Path, sig: int
) -> None:
    """Exit 143 or 130 with nothing on stderr: the operator could not tell that nothing ran."""
    marker = tmp_path / "pre-faulted"
    name = f"replay_prefault_{tmp_path.name[-12:]}"
    config = tmp_path / "tiers.toml"
    config.write_text(f'l1_shm_name = "{name}"\n')
    segment = Path("/dev/shm") / name
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--in-process", "--l1-blocks", "50", "--config", str(config), "--json"]
    replay = _launch_held("lmcache_tiers.l1.segment", "_reserve_and_map", marker, args)
    try:
        _wait_for(marker, replay)
        assert segment.exists()
        replay.send_signal(sig)
        out, err = replay.communicate(timeout=60)
        assert not segment.exists(), "the L1 segment outlived the replay"
    finally:
        replay.kill()
        segment.unlink(missing_ok=True)
    assert replay.returncode == 128 + sig, err
    assert out == ""
    assert _one_error_line(err) == (
        f"error: interrupted ({signal.Signals(sig).name}) while building the in-process storage "
        "(pre-faulting its L1); nothing was replayed"
    )


def test_a_signal_as_the_plot_is_written_leaves_no_half_written_file(tmp_path: Path) -> None:
    """The plot was drawn straight into the --plot file: a signal mid-write left a truncated
    image there, which a later look at the directory takes for the curve."""
    marker = tmp_path / "drawn"
    plots = tmp_path / "plots"
    plots.mkdir()
    plot = plots / "curve.png"
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--simulate", "--capacity", "8", "--plot", str(plot)]
    code, out, err = _signal_once_held(
        _launch_held("matplotlib.figure", "Figure.savefig", marker, args), marker, signal.SIGTERM
    )
    assert code == 128 + signal.SIGTERM, err
    assert out == ""
    assert _one_error_line(err) == (
        f"error: interrupted (SIGTERM) while writing the plot {plot}; no report, and no plot written"
    )
    assert list(plots.iterdir()) == []


def test_a_second_signal_stops_waiting_for_client_processes_and_the_server(tmp_path: Path) -> None:
    """With a server that no longer answers, the client processes of a replay stopped by
    Ctrl-C each waited out their give-back (seconds) and the replay then waited for the
    server's counters; a second signal was ignored, however often the operator sent it.
    Now it kills the client processes still unwinding and skips the counters."""
    server = start_block_server(tmp_path / "server", 500)
    trace = str(small_trace(tmp_path / "t.jsonl", requests=4000))  # 20 s of arrivals
    args = ["replay", trace, "--url", server.url, "--block-bytes", str(BLOCK_BYTES), "--time-scale", "1"]
    replay = launch_cli([*args, "--clients", "2", "--json"])
    frozen = False
    try:
        deadline = time.monotonic() + 60
        with Client(server.url, name="watch", shm=False) as watch:
            while True:  # both client processes connected, requests under way
                status = watch.status()
                if status["frontends"][0]["clients"] >= 2 and status["requests"]["lookups"] > 0:
                    break
                assert replay.poll() is None and time.monotonic() < deadline, output_of_killed(replay)
                time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGSTOP)  # answers nothing from here on
        frozen = True
        replay.send_signal(signal.SIGINT)
        replay.send_signal(signal.SIGTERM)  # the second
        out, err = replay.communicate(timeout=120)
    finally:
        replay.kill()
        if frozen:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop(signal.SIGKILL)
    # The replay stops as the signal it handles first asked. That is SIGINT when both are
    # pending (CPython runs their handlers in signal-number order), but one run on a loaded
    # machine handled SIGTERM first, the two sent back to back. Either way the other one
    # cuts the waits short.
    names = {130: ("SIGINT", "SIGTERM"), 143: ("SIGTERM", "SIGINT")}
    assert replay.returncode in names, err
    first, second = names[replay.returncode]
    assert "Traceback" not in err, err
    # (while the client processes were still being started, if the second signal came then)
    assert f"replay: {second} came again" in err, err
    # killed while they waited on the server, instead of waited for
    assert "2 of 2 client processes ended without their figures" in err, err
    document = json.loads(out)
    assert document["stopped"] == (
        f"interrupted ({first}) after {document['requests']:,} of 4,000 requests; "
        "the server's counters could not be read: a second signal asked not to wait for them"
    )
    assert document["l1_hit_blocks"] is None


def test_ctrl_c_as_the_command_starts_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C while the command loaded its plugins, before any command ran, printed a
    KeyboardInterrupt traceback."""
    marker = tmp_path / "loaded"
    args = ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate"]
    code, out, err = _signal_once_held(
        _launch_held("lmcache_tiers.plugins", "load_plugins", marker, args), marker, signal.SIGINT
    )
    assert code == 130, err
    assert out == ""
    assert _one_error_line(err) == "error: interrupted (SIGINT) as the command started"


def test_a_signal_as_the_trace_is_re_timed_names_that_step(tmp_path: Path) -> None:
    """--retime re-times the trace before the simulation (a minute per 100,000 requests):
    a signal there said 'while checking the options'."""
    marker = tmp_path / "re-timed"
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--simulate", "--retime", "0", "--capacity", "8"]
    code, out, err = _signal_once_held(
        _launch_held("lmcache_tiers.replay.analysis", "prepare", marker, args), marker, signal.SIGTERM
    )
    assert code == 128 + signal.SIGTERM, err
    assert out == ""
    assert _one_error_line(err) == (
        "error: interrupted (SIGTERM) while re-timing the trace (--retime); "
        "no report: the simulation had not started"
    )


def test_ctrl_c_as_the_replay_loads_its_modules_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C once the command ran but before the replay's signal handling was in place (its
    modules loading, a good part of a second on a loaded machine) ended it with exit 130 and
    not a word: typer turns a KeyboardInterrupt into a silent exit."""
    marker = tmp_path / "importing"
    args = ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate"]
    replay = launch_script(_HELD_IMPORT, "lmcache_tiers.replay.run", str(marker), *args)
    code, out, err = _signal_once_held(replay, marker, signal.SIGINT)
    assert code == 130, err
    assert out == ""
    assert _one_error_line(err) == "error: interrupted (SIGINT) while starting; nothing was replayed"


@START_SIGNALS
def test_a_signal_as_the_plugins_load_is_one_line(tmp_path: Path, sig: int) -> None:
    """SIGTERM before the command's handlers were in place (the plugins loading, a second
    on a loaded machine) ended the process silently: exit -15, not a word."""
    marker = tmp_path / "loaded"
    args = ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate"]
    code, out, err = _signal_once_held(
        _launch_held("lmcache_tiers.plugins", "load_plugins", marker, args), marker, sig
    )
    assert code == 128 + sig, err
    assert out == ""
    name = signal.Signals(sig).name
    assert _one_error_line(err) == f"error: interrupted ({name}) as the command started"


#: the console script as installed (``from lmcache_tiers.cli.main import main``), with the
#: import of MODULE creating the file MARKER and waiting
_ENTRY_POINT_HELD = _HELD_IMPORT.replace(
    'from lmcache_tiers.cli.main import main\nsys.argv[0] = "lmcache-tiers"\nmain(sys.argv[1:])',
    'from lmcache_tiers.cli.main import main\nsys.argv[0] = "lmcache-tiers"\nsys.exit(main())',
)


@START_SIGNALS
def test_a_signal_as_the_entry_point_imports_is_one_line(tmp_path: Path, sig: int) -> None:
    """The console script imports the command line's modules (typer, rich, the config)
    before calling main: Ctrl-C there printed a KeyboardInterrupt traceback, SIGTERM ended
    it silently.  The entry point's module now imports nothing heavy before main() has
    put the handling in place; typer is the first heavy import after it."""
    assert "sys.exit(main())" in _ENTRY_POINT_HELD
    marker = tmp_path / "importing"
    args = ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate"]
    replay = launch_script(_ENTRY_POINT_HELD, "typer", str(marker), *args)
    code, out, err = _signal_once_held(replay, marker, sig)
    assert code == 128 + sig, err
    assert out == ""
    name = signal.Signals(sig).name
    assert _one_error_line(err) == f"error: interrupted ({name}) as the command started"
