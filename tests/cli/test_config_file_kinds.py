"""What ``serve --config`` reads: a regular file, or a pipe whose writer ends it (a shell's
``<(generate-config)``, ``/dev/stdin`` fed by a pipe).  Anything else is refused in one
line, exit 2, before it is read -- a FIFO nobody writes to no longer holds start-up for
ever, and /dev/null is no empty config."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from startup_refusals import print_config, serve_refused
from thirdparty import CLI

CONFIG = "l1_size_gb = 0.5\nchunk_size = 128\n"


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "config.fifo"
    os.mkfifo(path)
    return path


def test_a_fifo_nobody_writes_to_is_refused_at_once(fifo: Path) -> None:
    line = serve_refused(["--no-default-l2", "--config", str(fifo)])
    assert line.startswith(f"error: config file '{fifo}' is a FIFO or pipe with nothing written to it"), line


@pytest.mark.parametrize(
    ("path", "start"),
    [
        ("/dev/null", "error: config file '/dev/null' is a character device, not a file"),
        ("/dev/zero", "error: config file '/dev/zero' is a character device, not a file"),
    ],
)
def test_a_device_is_refused(path: str, start: str) -> None:
    assert serve_refused(["--no-default-l2", "--config", path]).startswith(start)


def test_a_directory_and_a_huge_file_are_refused(tmp_path: Path) -> None:
    line = serve_refused(["--no-default-l2", "--config", str(tmp_path)])
    assert line.startswith(f"error: config file '{tmp_path}' is a directory"), line
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as handle:
        handle.truncate(4 << 30)  # sparse: no disk taken
    line = serve_refused(["--no-default-l2", "--config", str(huge)])
    assert line.startswith(f"error: config file '{huge}' is larger than 1 MiB"), line


def test_a_regular_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "tiers.toml"
    config.write_text(CONFIG)
    printed = print_config(["--no-default-l2", "--config", str(config)], monkeypatch)
    assert printed.returncode == 0, printed.stderr
    assert '"chunk_size": 128' in printed.stdout


def test_a_pipe_is_read_to_its_end() -> None:
    # /dev/stdin fed by a pipe: what a shell's <(...) gives too
    result = subprocess.run(
        [*CLI, "serve", "--no-default-l2", "--print-config", "--config", "/dev/stdin"],
        input=CONFIG,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert '"chunk_size": 128' in result.stdout


@pytest.fixture
def held_pipe() -> Iterator[str]:
    """A pipe whose writer keeps it open without writing: its path in this process."""
    read_end, write_end = os.pipe()
    try:
        yield f"/dev/fd/{read_end}"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_pipe_whose_writer_never_ends_is_refused(held_pipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lmcache_tiers.config.CONFIG_PIPE_WAIT_S", 0.2)
    printed = print_config(["--no-default-l2", "--config", held_pipe], monkeypatch)
    assert printed.returncode == 2, printed.stdout
    assert printed.stderr.strip() == (
        f"error: config file '{held_pipe}' is a pipe its writer did not finish within 0.2 s; "
        "serve reads --config once, at start"
    )
