"""Client processes that prepare a one-chunk store and never commit it (``stalled_writer.py``),
and what the server holds for them: the fence tests' helpers."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from mpclient import mp_address

from lmcache_tiers.server.app import TiersServer

STALLED_WRITER = Path(__file__).with_name("stalled_writer.py")


def stop_writers(started: list[subprocess.Popen[str]]) -> None:
    """Kill the writers still running (a stopped one too) and reap them all."""
    for process in started:
        if process.poll() is None:
            process.kill()
            process.send_signal(signal.SIGCONT)
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


def start_writer(
    server: TiersServer, instance_id: int, sequence: int, writers: list[Any], routing_id: str = ""
) -> Any:
    """A client process whose one-chunk reservation is prepared and never committed."""
    extra = [routing_id] if routing_id else []
    process = subprocess.Popen(
        [sys.executable, str(STALLED_WRITER), mp_address(server), str(instance_id), str(sequence), *extra],
        stdout=subprocess.PIPE,
        text=True,
    )
    writers.append(process)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "prepared 1"
    return process


def fenced_extents(server: TiersServer) -> int:
    return int(server.storage_status()["l1"]["leases"]["fenced_extents"])


def transfers_of(server: TiersServer) -> Any:
    frontend: Any = server.frontends[0]  # make_mp_server's LMCache front end
    return frontend.handlers.transfers
