"""A peer may choose its routing identity, one of those libzmq hands out itself too.  When
libzmq later hands a new connection (LMCache's clients never choose theirs) an identity a
peer holds, an assertion aborts the whole server; and it numbered connections from the
same start in every server, so claiming the next identities and connecting once more
killed the server.  The server runs in a process of its own here: the abort would take
the test run with it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mpclient import MPClient

from lmcache_tiers.testing.ports import free_ports
from lmcache_tiers.testing.routing_ids import identities_claimed


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port, metrics_port = free_ports(2)
    frontend = f'{{"type": "lmcache_mp", "port": {port}}}'
    shm_name = f"tiers_claim_{port}"
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [
            *(str(Path(sys.executable).with_name("lmcache-tiers")), "serve", "--host", "127.0.0.1"),
            *("--l1-size-gb", "0.0625", "--no-default-l2", "--metrics-port", str(metrics_port)),
            *("--shm-name", shm_name, "--frontend", frontend),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"tcp://127.0.0.1:{port}"
    try:
        with MPClient(url, timeout_ms=60_000) as first:
            assert first.call("noop") == "OK", (tmp_path / "server.log").read_text()
        yield url, process
    finally:
        process.terminate()
        process.wait(60)
        log.close()
        # an aborted server leaves its segment behind
        Path(f"/dev/shm/{shm_name}").unlink(missing_ok=True)


def test_a_peer_holding_the_identities_libzmq_hands_out_next_does_not_kill_the_server(
    served: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, process = served
    with identities_claimed(url, [b"\x00", b"\x18"]):  # uid 0, noop
        for _ in range(8):  # ordinary clients, numbered by libzmq
            with MPClient(url, timeout_ms=20_000) as client:
                assert client.call("noop") == "OK"
        assert process.poll() is None
