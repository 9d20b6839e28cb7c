"""A list of adapters or front ends in the ``--config`` file that is no list is one line
naming the file, also when a flag replaces that list: an operator with flags and a file
must not have to guess which one the error is about."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--print-config", "--no-default-l2"]


@pytest.mark.parametrize(
    ("toml", "flags", "message"),
    [
        (
            'l2_adapters = {type = "mock"}\n',
            [],
            "expected a list of tables (`[[l2_adapters]]`) - at `$.l2_adapters`",
        ),
        # replaced by the flag, yet wrong in the file: the file is named, not left unsaid
        (
            'l2_adapters = "mock"\n',
            ["--l2-adapter", '{"type": "mock"}'],
            "expected a list of tables (`[[l2_adapters]]`) - at `$.l2_adapters`",
        ),
        ("frontends = 3\n", ["--frontend", '{"type": "native"}'], "- at `$.frontends`"),
    ],
)
def test_a_mistake_in_the_file_names_the_file(
    tmp_path: Path, toml: str, flags: list[str], message: str
) -> None:
    (tmp_path / "tiers.toml").write_text(toml)
    result = subprocess.run(
        [*CLI, "--config", "tiers.toml", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("error: --config tiers.toml: "), line
    assert message in line, line
