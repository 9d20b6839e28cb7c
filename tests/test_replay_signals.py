"""``lmcache-tiers replay`` stopped by SIGTERM or Ctrl-C before or after the replay proper
(reading the trace, simulating, pre-faulting an in-process L1): one line naming the signal
and what was cut short, exit 128 + the signal, nothing left in /dev/shm.

The test sends the signal once the replay is known to be in that step: a trace that is a
named pipe the test holds open, or a hook, run in the replay's process, that says (by
creating a file) that the step has begun and then waits there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from replay_helpers import output_of_killed, small_trace
from thirdparty import launch_cli
from tiers_e2e import stop_signals_at_default

SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])

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
        time.sleep(3600)  # until the test's signal
    return result

setattr(owner, attribute, held)
from lmcache_tiers.cli.main import main
sys.argv[0] = "lmcache-tiers"
main(sys.argv[1:])
"""


def _launch_held(module: str, attribute: str, marker: Path, args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _HOOK, module, attribute, str(marker), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=stop_signals_at_default(),
    )


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
    replay = _launch_held(
        "lmcache_tiers.replay.simulate", "simulate_curve", marker, ["replay", trace, "--simulate", "--json"]
    )
    try:
        _wait_for(marker, replay)
        replay.send_signal(sig)
        out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
    assert replay.returncode == 128 + sig, err
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
    replay = _launch_held("matplotlib.figure", "Figure.savefig", marker, args)
    try:
        _wait_for(marker, replay)  # the image is written, the command not done with it
        replay.send_signal(signal.SIGTERM)
        out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
    assert replay.returncode == 128 + signal.SIGTERM, err
    assert out == ""
    assert _one_error_line(err) == (
        f"error: interrupted (SIGTERM) while writing the plot {plot}; no report, and no plot written"
    )
    assert list(plots.iterdir()) == []
