"""Fixtures the command-line tests share."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_cli import ForkedCli


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on for the test's length."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    """A regular file where a directory, a device or a socket is expected."""
    path = tmp_path / "regular-file"
    path.write_bytes(b"not a directory")
    return path


@pytest.fixture(scope="module")
def forked_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkedCli]:
    """The console script forked from one warm interpreter per test module."""
    cli = ForkedCli(tmp_path_factory.mktemp("forked-cli"))
    try:
        yield cli
    finally:
        cli.close()
