"""``lmcache-tiers bench`` with its output sent to a file or a pipe: the progress bar is for
a terminal, and off one it must leave nothing behind (a blank line before the figures, or
before the one-line refusal a script reads)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from thirdparty import run_cli_in_process

from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import ServerHarness


@pytest.fixture
def server() -> Iterator[TiersServer]:
    harness = ServerHarness()
    try:
        yield harness.make(l1_size_gb=0.0625)
    finally:
        harness.close()


def test_a_refused_batch_prints_only_its_error_line(server: TiersServer) -> None:
    result = run_cli_in_process(["bench", "--url", server.endpoint, "--chunks", "64", "--chunk-mib", "2"])
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("error: --chunks 64 x --chunk-mib 2: one batch")
    assert result.stderr.count("\n") == 1


def test_the_figures_are_the_first_thing_printed(server: TiersServer) -> None:
    result = run_cli_in_process(
        [
            "bench",
            "--url",
            server.endpoint,
            "--chunks",
            "2",
            "--chunk-mib",
            "0.0625",
            "--repeats",
            "1",
            "--lookup-requests",
            "10",
            "--no-inline",
        ]
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("lmcache-tiers bench: 2 x 0.0625 MiB, median of 1\n"), result.stdout[:200]
