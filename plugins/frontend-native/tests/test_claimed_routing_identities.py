"""A peer may choose its routing identity, one of those libzmq hands out itself too.  When
libzmq later hands a new connection (the Python client never chooses its own) an identity
a peer holds, an assertion aborts the whole server; unseeded, it numbered connections from
the same start in every server, so claiming the next identities and connecting once more
killed it.  The server runs in a process of its own here: the abort would take the test
run with it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.testing.ports import free_ports
from lmcache_tiers.testing.routing_ids import identities_claimed
from lmcache_tiers.wire import protocol as p


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port, metrics_port = free_ports(2)
    shm_name = f"tiers_claim_native_{port}"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *(str(Path(sys.executable).with_name("lmcache-tiers")), "serve", "--host", "127.0.0.1"),
                *("--port", str(port), "--l1-size-gb", "0.0625", "--no-default-l2"),
                *("--metrics-port", str(metrics_port), "--shm-name", shm_name),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"tcp://127.0.0.1:{port}"
    try:
        with Client(url, timeout=60) as first:
            first.ping()
        yield url, process
    finally:
        process.terminate()
        process.wait(60)
        Path(f"/dev/shm/{shm_name}").unlink(missing_ok=True)  # an aborted server leaves it
        assert "Assertion failed" not in log_path.read_text(errors="replace")


def test_a_peer_holding_the_identities_libzmq_hands_out_next_does_not_kill_the_server(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, process = served
    with identities_claimed(url, [p.encode(p.Ping(1, ""))]):
        for _ in range(8):  # ordinary clients, numbered by libzmq
            with Client(url, timeout=20) as client:
                client.ping()
        assert process.poll() is None
