"""``replay --simulate`` refuses options that would do nothing or that do not add up, in one
line that says which and why, with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_support import run_replay, synthetic_lines, write_trace


@pytest.fixture
def trace(tmp_path: Path) -> str:
    return str(write_trace(tmp_path / "trace.jsonl", synthetic_lines(3, requests=40)))


def test_an_eviction_ratio_without_a_watermark_is_refused(
    capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    # The ratio is what a background round frees, and --simulate runs no background round
    # unless a watermark is given: the figures would be those without it, whatever it said.
    code, out, err = run_replay(capsys, trace, "--simulate", "--capacity", "8", "--eviction-ratio", "0.5")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "--eviction-ratio" in err and "--eviction-trigger-watermark" in err


def test_an_eviction_ratio_with_a_watermark_is_simulated(
    capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    code, out, err = run_replay(
        capsys,
        trace,
        "--simulate",
        "--capacity",
        "8",
        "--policy",
        "LRU",
        "--eviction-trigger-watermark",
        "0.9",
        "--eviction-ratio",
        "0.5",
        "--json",
    )
    assert code == 0, err
    settings = json.loads(out)["settings"]
    assert settings["trigger_watermark"] == 0.9 and settings["eviction_ratio"] == 0.5


def test_l2_capacities_that_do_not_match_the_default_capacities_say_so(
    capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    # Without --capacity, "one --l2-capacity per --capacity (1)" named a count of values the
    # operator never gave.
    code, out, err = run_replay(capsys, trace, "--simulate", "--l2-capacity", "1k,2k")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "default capacities" in err and "--capacity" in err and "2" in err


def test_an_empty_plot_file_name_is_refused(capsys: pytest.CaptureFixture[str], trace: str) -> None:
    # --plot "$OUT" with OUT unset: the simulation ran and printed its tables, and no
    # plot was drawn, without a word.
    code, out, err = run_replay(capsys, trace, "--simulate", "--capacity", "8", "--plot", "")
    assert code == 2 and out == ""
    assert err.strip() == "error: --plot '' names no file; leave it out for no plot"
