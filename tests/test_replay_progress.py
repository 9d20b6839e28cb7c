"""``lmcache-tiers replay`` on a terminal: progress bars on stderr, with or without --json
(the report on stdout stays the report)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
from pathlib import Path

import pytest
from replay_helpers import small_trace
from thirdparty import CLI


def run_with_terminal_stderr(args: list[str]) -> tuple[int, str, str]:
    """The command with its stderr on a pseudo-terminal and its stdout on a pipe, as
    ``lmcache-tiers replay ... --json > report.json`` typed at a terminal: exit code,
    stdout, and what the terminal got."""
    main, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            CLI + args,
            stdout=subprocess.PIPE,
            stderr=terminal,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, TERM="xterm", COLUMNS="120"),
        )
    finally:
        os.close(terminal)
    drawn = bytearray()
    try:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(main)
    assert process.stdout is not None
    out = process.stdout.read().decode()
    return process.wait(timeout=120), out, drawn.decode(errors="replace")


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_a_simulation_on_a_terminal_shows_its_bars(tmp_path: Path, as_json: bool) -> None:
    """With --json the bars were never drawn: a long simulation written to a file showed
    nothing at all on the terminal, though the bars go to stderr, not into the report."""
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--simulate", "--capacity", "8,16", *(["--json"] if as_json else [])]
    code, out, drawn = run_with_terminal_stderr(args)
    assert code == 0, drawn
    assert "reading the trace" in drawn and "simulating" in drawn, drawn
    if as_json:
        assert json.loads(out)["trace"]["requests"] == 60
    else:
        assert "miss ratio" in out


def test_an_in_process_replay_with_json_on_a_terminal_shows_its_bar(tmp_path: Path) -> None:
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--in-process", "--l1-size-gb", "0.01", "--json"]
    code, out, drawn = run_with_terminal_stderr(args)
    assert code == 0, drawn
    assert "replaying (in-process)" in drawn, drawn
    assert json.loads(out)["requests"] == 60
