"""``replay --in-process`` refuses options that contradict each other in one line that
names where each came from, with exit code 2, before it builds any storage."""

from __future__ import annotations

from pathlib import Path

import pytest
from replay_support import run_replay, synthetic_lines, write_trace


@pytest.fixture
def trace(tmp_path: Path) -> str:
    return str(write_trace(tmp_path / "trace.jsonl", synthetic_lines(5, requests=20)))


def test_l1_blocks_and_l1_size_gb_on_the_command_line_are_refused(
    capsys: pytest.CaptureFixture[str], trace: str
) -> None:
    code, out, err = run_replay(capsys, trace, "--in-process", "--l1-blocks", "10", "--l1-size-gb", "0.01")
    assert code == 2 and out == ""
    assert err.strip() == "error: give --l1-blocks or --l1-size-gb, not both"


@pytest.mark.parametrize(
    ("lines", "named"),
    [
        ("l1_size_gb = 0.01\n", "l1_size_gb"),
        # the alignment was replaced by --l1-blocks' own, the file's value dropped silently
        ("l1_align_bytes = 8192\n", "l1_align_bytes"),
        ("l1_size_gb = 0.01\nl1_align_bytes = 8192\n", "l1_size_gb and l1_align_bytes"),
    ],
)
def test_l1_blocks_with_a_config_file_that_sizes_l1_names_the_file(
    capsys: pytest.CaptureFixture[str], trace: str, tmp_path: Path, lines: str, named: str
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(lines)
    code, out, err = run_replay(capsys, trace, "--in-process", "--l1-blocks", "10", "--config", str(config))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    # not "--l1-size-gb", a flag the operator never gave
    assert "--l1-size-gb" not in err
    assert str(config) in err and f"gives {named}:" in err
