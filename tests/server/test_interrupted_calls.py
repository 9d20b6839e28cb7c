"""A call interrupted while it waits for its reply (a signal handler raising, Ctrl-C in a
notebook) is given up on like one that timed out: what its late reply took on the
client's behalf is given back when that reply arrives, not held until the server's TTL."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from tiers_e2e import make_keys, make_payloads, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.testing.processes import freeze

CLIENT_TIMEOUT_S = 120.0


class _Interrupted(Exception):
    """What the test's signal handler raises in the middle of a call."""


@pytest.fixture
def interrupting_signal() -> Iterator[signal.Signals]:
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        yield signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_locks_of_an_interrupted_lookup_are_given_back_when_its_reply_lands(
    tmp_path: Path, interrupting_signal: signal.Signals
) -> None:
    server = start_server(tmp_path / "server")
    client = Client(server.url, timeout=CLIENT_TIMEOUT_S)
    keys = make_keys("interrupted", 4)
    try:
        assert client.store(keys, make_payloads("interrupted", 4, 64 << 10)) == 4
        client.release(keys)
        freeze(server.proc.pid)  # the LOOKUP is sent, and answered only after the interruption
        timer = threading.Timer(0.5, os.kill, (os.getpid(), interrupting_signal))
        timer.start()
        try:
            with pytest.raises(_Interrupted):
                client.lookup(keys)
        finally:
            timer.join()
            os.kill(server.proc.pid, signal.SIGCONT)
        # The late reply (4 hits, locked for this client) arrives before the first PING's;
        # the second PING comes after whatever the client sent on reading it.
        client.ping()
        client.ping()
        assert client.status()["server"]["locked_keys"] == 0
        # The calls after the interruption are not slowed or confused by it.
        assert not client._outstanding and not client._early
        assert client.lookup(keys) == 4
        client.release(keys)
    finally:
        client.close()
        assert server.stop() == 0, server.output()
