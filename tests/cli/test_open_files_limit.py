"""A server at its open files limit: libzmq's accept fails with EMFILE and retries without
telling the application, so new clients only time out. The server sees it from its own
descriptor count, counts it and logs it once per burst, and keeps serving the clients it
has."""

from __future__ import annotations

import os
import resource
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from thirdparty import free_port, launch_l1_only_serve
from tiers_e2e import stop_signals_at_default

from lmcache_tiers.client import Client, ClientError

LIMIT = 64
#: generous: the server's maintenance turns about once a second
DEADLINE_S = 60.0


def _exhausted(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("lmcache_tiers_failures_total") and 'reason="open_files_exhausted"' in line
    )


def _limited() -> None:
    stop_signals_at_default()()
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def test_a_server_at_its_open_files_limit_counts_it_and_serves_on(tmp_path: Path) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < LIMIT:
        pytest.skip(f"the hard limit of open files here is {hard}, below {LIMIT}")
    port, metrics_port = free_port(), free_port()
    url = f"tcp://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    shm = f"tiers_nofile_{uuid.uuid4().hex[:10]}"
    with log.open("w") as out:
        proc = launch_l1_only_serve(
            out, shm_name=shm, port=port, metrics_port=metrics_port, preexec_fn=_limited
        )
    clients: list[Client] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        first = None
        while first is None:
            try:
                first = Client(url, timeout=2, shm=False)
            except ClientError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        clients.append(first)
        # Connections until the server has no descriptor left (the later ones wait, and
        # the HTTP endpoint cannot accept a scrape either): its log says so.
        while "open files limit reached" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                clients.append(Client(url, timeout=0.5, shm=False))
            except ClientError:
                pass
        assert first.ping(timeout=10) >= 0  # a client it has is still served
        for client in clients[1:]:
            client.close()
        del clients[1:]
        # The clients gone, descriptors are free again: the scrape shows the count.
        while True:
            try:
                exhausted = _exhausted(metrics_port)
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
        assert exhausted >= 1
        text = log.read_text()
        assert text.count("open files limit reached") == 1, text  # once per burst
        assert f"ulimit -n is {LIMIT}" in text, text
        assert first.ping(timeout=10) >= 0
    finally:
        for client in clients:
            client.close()
        proc.terminate()
        proc.wait(120)
    assert not os.path.exists(f"/dev/shm/{shm}")
