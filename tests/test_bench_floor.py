"""bench_server's transport floor: the echo request is the request it stands for, and the
placement of the alternating rounds is given back."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from bench_modules import load_bench

import lmcache_tiers.client.connection as connection
from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import make_server

__all__ = ["make_server"]


def test_the_echo_request_is_as_long_as_the_lookup_the_client_sends(
    make_server: Callable[..., TiersServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The floor's request is the client's LOOKUP of the same keys, byte for byte in
    length (its request id of the same width, the wait the client adds): the bare round
    trip moves what the LOOKUP moves.  It was a request of other keys, half as long."""
    bench_server = load_bench("bench_server")
    server = make_server()
    keys = bench_server.run_bench_keys(16)
    sent: list[bytes] = []
    raw_send = connection._raw_send

    def recording(sock: Any, data: Any, flags: int = 0) -> Any:
        sent.append(bytes(data))
        return raw_send(sock, data, flags)

    with Client(server.endpoint) as client:
        client.store(keys, [bytes(4096)] * len(keys), l1_only=True)
        # a request id of the width the floor's has, as in a run of tens of thousands
        client._ids = itertools.count(1 << 20)
        monkeypatch.setattr(connection, "_raw_send", recording)
        assert client.lookup(keys) == len(keys)
        monkeypatch.undo()
        client.release(keys)
    assert len(sent) == 1
    assert len(bench_server.floor_request(keys)) == len(sent[0])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_pinned_puts_every_thread_of_a_process_on_its_cpu_and_gives_the_old_placement_back() -> None:
    bench_server = load_bench("bench_server")
    # a process with a second thread, started before the pinning
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, sys\n"
            "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
            "print(1, flush=True)\n"
            "sys.stdin.readline()\n"
            "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
            "print(2, flush=True)\n"
            "sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "1"
        tasks = [int(task) for task in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tasks) >= 2
        before = {task: os.sched_getaffinity(task) for task in tasks}
        cpu = max(os.sched_getaffinity(0))
        with bench_server.pinned({child.pid: cpu}):
            assert all(os.sched_getaffinity(task) == {cpu} for task in tasks)
            child.stdin.write("start\n")  # a third thread, started pinned
            child.stdin.flush()
            assert child.stdout.readline().strip() == "2"
            started = set(map(int, os.listdir(f"/proc/{child.pid}/task"))) - set(tasks)
            assert len(started) == 1 and os.sched_getaffinity(started.pop()) == {cpu}
        after = {int(task): os.sched_getaffinity(int(task)) for task in os.listdir(f"/proc/{child.pid}/task")}
        assert after == {task: before.get(task, before[child.pid]) for task in after}
    finally:
        child.kill()
        child.wait()
