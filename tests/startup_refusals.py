"""What the start-up refusal tests of ``tests/cli`` share: a ``serve`` that must refuse
with one line, and ``serve --print-config`` run in the test process."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from thirdparty import run_cli, run_cli_in_process

#: a terminal narrower than every message: nothing may wrap
NARROW = {"COLUMNS": "40"}


def serve_refused(args: list[str], **env: str) -> str:
    """Run ``serve ARGS`` with a segment name of its own; return its one error line,
    having checked the exit code and that no L1 segment was created."""
    shm = f"tiers_preflight_{uuid.uuid4().hex[:10]}"
    result = run_cli(
        ["serve", "--l1-size-gb", "0.25", "--shm-name", shm, "--metrics-port", "0", *args], **NARROW, **env
    )
    assert result.returncode == 2, result.stdout + result.stderr
    # Other servers killed on this machine leave segments that any start-up removes with a
    # log line of its own: not part of the refusal, and outside the test's control.
    lines = [line for line in result.stderr.strip().splitlines() if " lmcache_tiers.l1.stale: " not in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert "Errno" not in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not os.path.exists(f"/dev/shm/{shm}")
    return lines[0]


def print_config(args: list[str], monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    """``serve --print-config ARGS`` on a narrow terminal, run in this process
    (``run_cli_in_process``: the same output as the console script, without a Python start
    per case); ``serve`` itself stays a real process in ``serve_refused``, which also
    checks that no L1 segment was made."""
    monkeypatch.setenv("COLUMNS", NARROW["COLUMNS"])
    return run_cli_in_process(["serve", "--print-config", *args])
