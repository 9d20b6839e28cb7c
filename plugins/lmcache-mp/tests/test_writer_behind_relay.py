"""A client reaching the server through a local relay keeps its fences when the relay exits.

Over loopback TCP the kernel names the process holding the far end of a connection; for a
client behind a relay (a port forward, a ZeroMQ proxy) that is the relay, which maps no
arena and copies nothing: the client keeps copying into its slots after the relay goes.
Watching the relay lifted the client's fences at the relay's exit, while the client could
still copy (wrong bytes in another object's extent).  A process that does not map the
segment is not the writer: the fence is held until commit or unregister, and counted.
The relay here is a real process forwarding bytes both ways, as ``socat`` would.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from mp_counts import mp_stats
from mpclient import wait_for
from writer_processes import STALLED_WRITER, fenced_extents, transfers_of

from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.children import TCP_RELAY, line_of, start_script

SHORT_TTL: dict[str, Any] = {"l1_write_ttl_s": 1.0, "l1_lock_ttl_s": 1.0}


def start(argv: list[str], started: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    started.append(process)
    return process


def sweeps_counted(server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A count of the server's sweeps of fences of exited writers from now on."""
    transfers = transfers_of(server)
    release = transfers._release_fences_of_exited_writers
    runs = [0]

    def counted() -> None:
        release()
        runs[0] += 1

    monkeypatch.setattr(transfers, "_release_fences_of_exited_writers", counted)
    return runs


def test_the_exit_of_a_relay_does_not_lift_the_fence_of_the_client_behind_it(
    make_mp_server: Any, writers: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    server: TiersServer = make_mp_server(**SHORT_TTL, host="127.0.0.1")
    address = next(f.address for f in server.frontends if f.name.endswith(":lmcache_mp"))
    relay = start_script(TCP_RELAY, str(address).rsplit(":", 1)[1], started=writers)
    relayed = f"tcp://127.0.0.1:{line_of(relay)}"
    writer = start([sys.executable, str(STALLED_WRITER), relayed, "1000", "1"], writers)
    assert line_of(writer) == "prepared 1"
    transfers = transfers_of(server)
    wait_for(
        lambda: fenced_extents(server) == 1 and transfers.writes.fenced, "the expired reservation fenced"
    )
    (fenced,) = [t for ts in transfers.writes.fenced.values() for t in ts]
    assert fenced.writer is not None
    wait_for(fenced.writer.armed.is_set, "the connection's process looked up")
    # counted by the sweep after the lookup, not as the lookup arms the watch
    wait_for(lambda: mp_stats(server).failures["mp_peer_not_writer"] == 1, "the relay counted as no writer")

    runs = sweeps_counted(server, monkeypatch)
    relay.kill()  # the client, alive and mapping the arena, may still copy
    relay.wait()
    wait_for(lambda: runs[0] >= 2, "two sweeps after the relay's exit")
    assert fenced_extents(server) == 1
    assert mp_stats(server).failures["mp_fence_writer_exited"] == 0
