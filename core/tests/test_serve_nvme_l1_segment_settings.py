"""``serve`` refuses a shared-memory segment's name or directory next to an NVMe L1
(--gds-l1-path): that L1 is a file with no segment, so the setting would be ignored
without a word.  The refusal is one line naming the flag or the --config file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--print-config", "--no-default-l2"]


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("args", "toml", "source", "field"),
    [
        (["--shm-name", "tiers_x"], "", "--shm-name", "l1_shm_name 'tiers_x'"),
        (["--shm-dir", "/dev/shm"], "", "--shm-dir", "l1_shm_dir '/dev/shm'"),
        ([], 'l1_shm_name = "tiers_y"\n', "--config tiers.toml", "l1_shm_name 'tiers_y'"),
        ([], 'l1_shm_dir = "/dev/shm"\n', "--config tiers.toml", "l1_shm_dir '/dev/shm'"),
    ],
)
def test_a_segment_setting_with_an_nvme_l1_is_refused(
    tmp_path: Path, args: list[str], toml: str, source: str, field: str
) -> None:
    blocks = tmp_path / "l1"
    blocks.mkdir()
    (tmp_path / "tiers.toml").write_text(f"gds_l1_path = {json.dumps(str(blocks))}\n{toml}")
    result = serve("--config", "tiers.toml", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = error_lines(result)
    assert line.startswith(f"error: {source}: {field} is for an L1 in shared memory"), line
    assert "gds_l1_path" in line and "drop one of the two" in line, line


@pytest.mark.parametrize("args", [[], ["--no-shm"], ["--shm-name", ""]])
def test_an_nvme_l1_without_segment_settings_is_accepted(tmp_path: Path, args: list[str]) -> None:
    blocks = tmp_path / "l1"
    blocks.mkdir()
    result = serve("--gds-l1-path", str(blocks), *args, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    config = json.loads(result.stdout)
    assert config["gds_l1_path"] == str(blocks) and config["l1_shm_name"] is None
