"""``lmcache-tiers replay``: what it refuses, in one line with exit code 2 (or 1 for a
server it cannot reach).  Its runs -- simulations, plots, replays and their ends -- are in
test_replay_runs.py.  These check exit codes and output only, so the command runs in this
process (a fraction of a second instead of a Python start and the plugin imports), except
where the test needs an interpreter of its own."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from replay_helpers import small_trace, start_block_server
from thirdparty import run_cli, run_cli_in_process


def _error_line(result) -> str:  # type: ignore[no-untyped-def]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_a_missing_trace_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli_in_process(["replay", str(tmp_path / "nope.jsonl"), "--simulate"])
    assert result.returncode == 2
    assert "does not exist" in _error_line(result)


def test_a_malformed_line_is_named(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    with trace.open("a") as handle:
        handle.write('{"timestamp": 9, "input_length": 10}\n')
    result = run_cli_in_process(["replay", str(trace), "--simulate"])
    assert result.returncode == 2
    assert "line 5" in _error_line(result)


def test_a_file_without_line_ends_is_one_line_and_exit_2() -> None:
    result = run_cli_in_process(["replay", "/dev/zero", "--simulate"])
    assert result.returncode == 2
    assert _error_line(result) == "error: /dev/zero line 1: longer than 16 MiB; not a request trace"


def test_times_no_clock_can_wait_for_are_one_line_and_exit_2(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    huge = tmp_path / "huge.jsonl"
    huge.write_text(
        trace.read_text() + '{"timestamp": 1e300, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    )
    server = start_block_server(tmp_path / "server", 50)
    try:
        for args, message in [
            ([str(huge), "--simulate"], "huge.jsonl line 5: timestamp 1e+300 is outside"),
            ([str(huge), "--url", server.url, "--time-scale", "1"], "huge.jsonl line 5: timestamp"),
            ([str(trace), "--url", server.url, "--time-scale", "1e300"], "a paced replay must fit"),
            ([str(trace), "--in-process", "--l1-blocks", "20", "--time-scale", "1e300"], "must fit"),
        ]:
            result = run_cli_in_process(["replay", *args])
            assert result.returncode == 2, result.stderr
            assert message in _error_line(result)
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.parametrize("capacity", ["-3", "zero", "12 parsecs", "0", "1.5", "1.2345k"])
def test_a_bad_capacity_is_one_line_and_exit_2(tmp_path: Path, capacity: str) -> None:
    result = run_cli_in_process(
        ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate", "--capacity", capacity]
    )
    assert result.returncode == 2
    assert "capacity" in _error_line(result)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--simulate", "--in-process"], "choose one of"),
        (["--simulate", "--policy", "LRUU"], "did you mean 'LRU'"),
        (["--simulate", "--capacity", "10,20", "--l2-capacity", "5"], "one --l2-capacity per --capacity"),
        (["--in-process", "--l1-blocks", "10", "--l1-size-gb", "1"], "not both"),
        # the flag, not the key's field (model_name, cache_salt), which the user never typed
        (["--in-process", "--model", "a@b"], "error: --model: model_name 'a@b' contains"),
        (["--url", "tcp://127.0.0.1:9", "--salt", "a/b"], "error: --salt: cache_salt 'a/b' contains"),
        (["--simulate", "--capacity", "100B"], "holds nothing"),
        (["--simulate", "--foresight", "soon"], "foresight horizon"),
        (["--simulate", "--retime-bandwidth", "5"], "needs --retime"),
        # numbers no machine holds: once tracebacks (OverflowError, or Python's refusal to
        # read an integer of more than 4300 digits)
        (["--simulate", "--capacity", "9" * 400], "more than 64 digits"),
        (["--simulate", "--capacity", "9" * 5000], "more than 64 digits"),
        (["--simulate", "--capacity", "9" * 30], "more than 2**53 blocks"),
        (["--simulate", "--retime", "0", "--retime-bandwidth", "1" + "0" * 400], "--retime-bandwidth"),
        (["--in-process", "--l1-blocks", "1" + "0" * 400], "no machine holds"),
        (["--in-process", "--l1-blocks", "2", "--block-bytes", "1" + "0" * 400], "no machine holds"),
        # a process each: refused before the server is asked, not once a million are spawned
        (["--url", "tcp://127.0.0.1:9", "--timeout", "0.3", "--clients", "1000000"], "'--clients'"),
    ],
)
def test_bad_combinations_are_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli_in_process(["replay", str(small_trace(tmp_path / "t.jsonl")), *args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in _error_line(result)


def test_a_fractional_block_count_is_refused_and_a_whole_one_is_not(tmp_path: Path) -> None:
    trace = str(small_trace(tmp_path / "t.jsonl"))
    result = run_cli_in_process(["replay", trace, "--simulate", "--capacity", "1.5"])
    assert result.returncode == 2
    assert "1.5 blocks is not a whole number of blocks" in _error_line(result)
    result = run_cli_in_process(
        ["replay", trace, "--simulate", "--capacity", "0.02k", "--policy", "LRU", "--json"]
    )
    assert result.returncode == 0, result.stderr
    assert [point["capacity_blocks"] for point in json.loads(result.stdout)["points"]] == [20]


SERVER = "a replay through a server (--url)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--simulate", "--config", "tiers.toml"],
            "--config applies only to --in-process, not to --simulate",
        ),
        (
            ["--simulate", "--l2-adapter", '{"type": "mock"}'],
            "--l2-adapter applies only to --in-process, not to --simulate",
        ),
        (
            ["--simulate", "--eviction-policy", "LRU"],
            "--eviction-policy applies only to --in-process, not to --simulate",
        ),
        (
            ["--simulate", "--salt", "s"],
            f"--salt applies only to --in-process and {SERVER}, not to --simulate",
        ),
        (["--in-process", "--clients", "3"], f"--clients applies only to {SERVER}, not to --in-process"),
        (
            ["--in-process", "--auth-token", "t"],
            f"--auth-token applies only to {SERVER}, not to --in-process",
        ),
        (["--in-process", "--plot", "c.png"], "--plot applies only to --simulate, not to --in-process"),
        (["--l1-blocks", "5"], f"--l1-blocks applies only to --in-process, not to {SERVER}"),
        (
            ["--eviction-ratio", "0.5"],
            f"--eviction-ratio applies only to --simulate and --in-process, not to {SERVER}",
        ),
        (["--capacity", "8"], f"--capacity applies only to --simulate, not to {SERVER}"),
    ],
)
def test_an_option_of_another_mode_is_refused_naming_where_it_applies(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = run_cli_in_process(["replay", str(small_trace(tmp_path / "t.jsonl")), *args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert _error_line(result) == f"error: {message}"


def test_an_auth_token_from_the_environment_is_no_option_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = str(small_trace(tmp_path / "t.jsonl"))
    monkeypatch.setenv("LMCACHE_TIERS_AUTH_TOKEN", "t")
    result = run_cli_in_process(["replay", trace, "--simulate", "--capacity", "8"])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("url", ["garbage", "tcp://127.0.0.1:99999", "tcp://::1:5555", "http://h:1"])
def test_a_url_no_client_can_connect_to_is_a_usage_error(tmp_path: Path, url: str) -> None:
    result = run_cli_in_process(["replay", str(small_trace(tmp_path / "t.jsonl")), "--url", url])
    assert result.returncode == 2
    assert _error_line(result).startswith("error: Invalid value for '--url': ")


def test_in_process_config_file_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    trace = str(small_trace(tmp_path / "t.jsonl"))
    result = run_cli_in_process(["replay", trace, "--in-process", "--config", str(tmp_path)])
    assert result.returncode == 2
    assert (
        _error_line(result) == f"error: config file '{tmp_path}' is a directory; give the path of a TOML file"
    )
    result = run_cli_in_process(["replay", trace, "--in-process", "--l1-size-gb", "inf"])
    assert result.returncode == 2
    assert _error_line(result) == "error: --l1-size-gb: Expected a finite number, got inf - at `$.l1_size_gb`"


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("curve.txt", "give a file name ending in .png, .svg or .pdf"),
        ("curve", "give a file name ending in .png, .svg or .pdf"),
        ("missing/curve.png", "does not exist"),
        ("a-directory.png", "is a directory; give a file name"),
        # refused at the end, after the simulation, when the plot could not be created there
        ("/proc/curve.png", "cannot create a file in /proc: "),
    ],
)
def test_a_plot_file_that_cannot_be_written_is_refused_before_the_simulation(
    tmp_path: Path, name: str, words: str
) -> None:
    (tmp_path / "a-directory.png").mkdir()
    plot = tmp_path / name
    # --policy LRUU would fail the simulation: the plot is refused before it starts
    args = ["--simulate", "--capacity", "8", "--policy", "LRUU", "--plot", str(plot)]
    result = run_cli_in_process(["replay", str(small_trace(tmp_path / "t.jsonl")), *args])
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith(f"error: --plot {plot}: ") and words in line, line
    assert result.stdout == ""
    assert not any(path.suffix == ".png" and path.is_file() for path in tmp_path.rglob("*"))


def test_an_unreachable_server_is_exit_1(tmp_path: Path) -> None:
    result = run_cli_in_process(
        ["replay", str(small_trace(tmp_path / "t.jsonl")), "--url", "tcp://127.0.0.1:9", "--timeout", "0.3"]
    )
    assert result.returncode == 1
    assert "replay through tcp://127.0.0.1:9 failed" in _error_line(result)


def test_plot_without_matplotlib_is_one_line_and_exit_2(tmp_path: Path) -> None:
    shadow = tmp_path / "site" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    png = tmp_path / "curve.png"
    result = run_cli(
        [
            "replay",
            str(small_trace(tmp_path / "t.jsonl")),
            "--simulate",
            "--capacity",
            "8",
            "--plot",
            str(png),
        ],
        site=tmp_path / "site",
    )
    assert result.returncode == 2
    assert "pip install 'lmcache-tiers[plot]'" in _error_line(result)
    assert not png.exists()


@pytest.mark.parametrize(
    ("content", "flags", "says"),
    [
        ("bogus_key = 1\n", [], "unknown config field `$.bogus_key`"),
        (
            '[l2_adapters]\ntype = "mock"\n',
            ["--l2-adapter", '{"type": "mock", "max_size_gb": 1}'],
            "expected a list of tables (`[[l2_adapters]]`) - at `$.l2_adapters`",
        ),
    ],
    ids=["unknown-key", "adapters-not-a-list"],
)
def test_an_in_process_config_files_own_mistake_names_the_file(
    tmp_path: Path, content: str, flags: list[str], says: str
) -> None:
    """As serve says it: the error named neither the file nor a flag, so a user with
    several config files could not tell which one held the key."""
    config = tmp_path / "tiers.toml"
    config.write_text(content)
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--in-process", "--l1-size-gb", "0.01", "--config", str(config), *flags]
    result = run_cli_in_process(args)
    assert result.returncode == 2
    assert _error_line(result) == f"error: --config {config}: {says}"


def test_an_empty_in_process_config_path_is_refused_not_ignored(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    result = run_cli_in_process(["replay", str(trace), "--in-process", "--l1-blocks", "20", "--config", ""])
    assert result.returncode == 2, result.stdout + result.stderr
    assert _error_line(result) == "error: config file '' does not exist"


def test_in_process_blocks_larger_than_l1_are_one_line_and_exit_2(tmp_path: Path) -> None:
    # A block no L1 could hold: once a traceback from allocating its scratch buffer.
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    args = ["replay", str(trace), "--in-process", "--l1-size-gb", "0.0625", "--block-bytes", str(1 << 40)]
    result = run_cli_in_process(args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert _error_line(result) == (
        f"error: --block-bytes {1 << 40}: larger than the L1 (--l1-size-gb 0.0625), "
        "which could hold no block; give smaller blocks or a larger L1"
    )


def test_blocks_larger_than_the_servers_l1_are_one_line_and_exit_2(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    server = start_block_server(tmp_path / "server", 20)
    try:
        result = run_cli_in_process(
            ["replay", str(trace), "--url", server.url, "--block-bytes", str(1 << 40)]
        )
        assert result.returncode == 2, result.stdout + result.stderr
        line = _error_line(result)
        assert line.startswith(f"error: --block-bytes {1 << 40}: larger than the L1 of {server.url} ("), line
    finally:
        assert server.stop() == 0, server.output()


def test_an_in_process_l1_too_small_for_one_extent_names_the_flag(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    result = run_cli_in_process(["replay", str(trace), "--in-process", "--l1-size-gb", "1e-12"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: "), result.stderr  # before any progress bar
    assert _error_line(result).startswith("error: --l1-size-gb 1e-12: smaller than one L1 extent")


def test_a_closed_stdout_is_refused_before_the_work(tmp_path: Path) -> None:
    """Started with stdout closed (``>&-``), the replay did all its work, lost the report
    without a word and exited 0."""
    from thirdparty import CLI

    args = ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate", "--capacity", "8", "--json"]
    result = subprocess.run(
        CLI + args,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.close(1),
    )
    assert result.returncode == 2, result.stderr
    assert _error_line(result).startswith("error: stdout is closed, and the report is written there")


def test_a_stdout_open_for_reading_only_is_refused_before_the_work(tmp_path: Path) -> None:
    """With stdout open for reading only (``1<&0``), the replay did all its work and then
    failed writing the report."""
    from thirdparty import CLI

    args = ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate", "--capacity", "8", "--json"]
    with open(os.devnull) as read_only:
        result = subprocess.run(CLI + args, stdout=read_only, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 2, result.stderr
    assert _error_line(result).startswith("error: stdout is open for reading only, and the report is written")


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_a_report_that_cannot_be_written_is_one_line_and_exit_1(tmp_path: Path, as_json: bool) -> None:
    """stdout on a full disk ended the run in a traceback once the work was done."""
    from thirdparty import CLI

    args = ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate", "--capacity", "8"]
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            CLI + args + (["--json"] if as_json else []), stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert result.returncode == 1, result.stderr
    assert _error_line(result) == "error: cannot write the report to stdout: No space left on device"


@pytest.mark.parametrize("flag", ["--policy", "--l2-policy"])
def test_an_unknown_policy_is_refused_before_the_trace_is_re_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """--retime re-times the trace (minutes for a long one) before the policy names were
    looked up: a typo cost that long."""
    from lmcache_tiers.replay import analysis

    prepared: list[object] = []
    prepare = analysis.prepare

    def noted(*args: Any) -> Any:
        prepared.append(args)
        return prepare(*args)

    monkeypatch.setattr(analysis, "prepare", noted)
    args = ["--simulate", "--retime", "0", "--capacity", "8", flag, "LRUU"]
    result = run_cli_in_process(["replay", str(small_trace(tmp_path / "t.jsonl")), *args])
    assert result.returncode == 2
    assert "unknown eviction policy 'LRUU'" in _error_line(result)
    assert prepared == []


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        # nan is neither below nor above a bound: typer's range check said it was
        ("--time-scale", "nan", "nan is not a finite number"),
        ("--time-scale", "-inf", "-inf is not a finite number"),
        ("--time-scale", "-1", "Input should be greater than or equal to 0"),
        ("--timeout", "nan", "nan is not a finite number"),
        ("--timeout", "1e9", "Input should be less than or equal to 86400"),
    ],
)
def test_a_float_option_that_is_not_a_finite_number_in_range_says_so(
    tmp_path: Path, flag: str, value: str, said: str
) -> None:
    trace = str(small_trace(tmp_path / "t.jsonl"))
    result = run_cli_in_process(["replay", trace, "--in-process", "--l1-blocks", "10", flag, value])
    assert result.returncode == 2
    assert _error_line(result) == f"error: Invalid value for '{flag}': {said}"
