"""bench/bench_replay.py refuses a bad trace or a bad argument in one line, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bench_modules import BENCH


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "bench_replay.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCH.parent,
    )


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "line 2: not a JSON object"),
        ('{"timestamp": 1, "input_length": 512, "hash_ids": [3]}', "line 2: Object missing required field"),
        ('{"timestamp": 1, "input_length": -1, "output_length": 1, "hash_ids": [3]}', "line 2: input_length"),
        (
            '{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": ["a"]}',
            "line 2: Expected `int`",
        ),
    ],
    ids=["not-json", "missing-field", "negative-length", "hash-id-not-int"],
)
def test_a_bad_trace_line_is_one_error_line_naming_it(tmp_path: Path, line: str, says: str) -> None:
    """Before: a TraceError traceback from read_trace, exit code 1."""
    trace = tmp_path / "bad.jsonl"
    first = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}'
    trace.write_text(f"{first}\n{line}\n")
    result = run_bench("--trace", str(trace), "--no-server")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {trace} ") and says in lines[0], lines


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--capacities", "0"], "argument --capacities: 0 is not >= 1"),
        (["--capacities", "1000,4k"], "argument --capacities: '4k' is not a whole number"),
        (["--study-capacities", "-5"], "argument --study-capacities: -5 is not >= 1"),
        (["--seeds", "-1"], "argument --seeds: -1 is not >= 0"),
        (["--block-bytes", "64"], "argument --block-bytes: 64 is not >= 128"),
    ],
)
def test_a_bad_argument_is_refused_before_any_work(args: list[str], says: str) -> None:
    """Before: ``--capacities 0`` a ValueError traceback after the whole policy study,
    ``4k`` a ValueError traceback, ``--seeds -1`` silently no re-timed samples."""
    result = run_bench(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "error:" in last and says in last, result.stderr
