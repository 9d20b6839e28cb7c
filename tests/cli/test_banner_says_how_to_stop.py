"""The start-up banner tells a first-time user how to stop the server, and whether Ctrl-C
does: a server started in a script's background inherits SIGINT ignored and keeps it so."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from rich.console import Console

from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.server.banner import start_banner
from lmcache_tiers.testing.server import ServerHarness


@pytest.fixture
def server() -> Iterator[TiersServer]:
    harness = ServerHarness()
    try:
        yield harness.make()
    finally:
        harness.close()


def _banner_text(server: TiersServer) -> str:
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(start_banner(server))
    return console.export_text()


def _stop_row(text: str) -> str:
    rows = [line for line in text.splitlines() if "│ stop" in line]
    assert rows, text
    return rows[0]


@pytest.fixture
def sigint_disposition() -> Iterator[None]:
    """Restores the test process's SIGINT disposition after a test changes it for real."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_banner_names_ctrl_c_and_sigterm_when_sigint_stops(
    server: TiersServer, sigint_disposition: None
) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    row = _stop_row(_banner_text(server))
    assert "Ctrl-C" in row and f"kill {os.getpid()}" in row, row


def test_banner_says_ctrl_c_does_not_stop_a_background_server(
    server: TiersServer, sigint_disposition: None
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    row = _stop_row(_banner_text(server))
    assert f"kill {os.getpid()}" in row and "Ctrl-C is ignored" in row, row
