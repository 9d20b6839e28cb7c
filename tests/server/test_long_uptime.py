"""A server and its clients over a long uptime: rounds of client churn must leave no
more behind than the first ones did, in the server process and in the client's."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tiers_e2e import ServerProcess, start_server
from uptime_churn import Holdings, churn_round, own_thread_names, wait_until_nothing_held

from lmcache_tiers.client import Client
from lmcache_tiers.wire.copies import SplitCopier

ROUNDS = 5
CLIENTS_PER_ROUND = 60
#: growth allowed between round 2 and the last one (a scrape's socket, a helper thread
#: between two jobs): leaks grow by tens per round
SLACK = 3


@pytest.fixture
def short_ttl_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server with the mock L2 whose read locks and reservations expire in 2 s."""
    proc = start_server(
        tmp_path / "server",
        adapters=[{"type": "mock", "max_size_gb": 0.5}],
        l1_lock_ttl_s=2.0,
        l1_write_ttl_s=2.0,
    )
    yield proc
    assert proc.stop() == 0, proc.output()


def test_client_churn_gives_back_what_it_took(short_ttl_server: ServerProcess) -> None:
    """Connections that store, read, leave prefetches uncollected and reservations
    uncommitted, close or are dropped or die: after the TTLs, round after round, neither
    the server nor the clients' process holds more file descriptors, threads or mappings
    of the L1 segment than after round 2."""
    server = short_ttl_server
    after: list[tuple[Holdings, Holdings]] = []
    for round_index in range(ROUNDS):
        churn_round(server, f"round{round_index}", CLIENTS_PER_ROUND)
        wait_until_nothing_held(server)
        after.append(
            (Holdings.of(server.proc.pid, server.shm_name), Holdings.of(os.getpid(), server.shm_name))
        )
    (server_early, client_early), (server_late, client_late) = after[1], after[-1]
    assert not server_late.grown_past(server_early, SLACK), server_late.grown_past(server_early, SLACK)
    grown = client_late.grown_past(client_early, SLACK)
    assert not grown, f"{grown}; threads now {own_thread_names()}"


def test_a_dropped_shared_memory_client_ends_its_copy_helper(short_ttl_server: ServerProcess) -> None:
    """A client the engine drops without ``close`` takes its threads with it once
    collected: one left per dropped client grows an engine that reconnects for good."""
    helpers_before = copy_helpers()
    for _ in range(20):
        client = Client(short_ttl_server.url, shm=True, timeout=30)
        client.ping()
        del client
    gc.collect()
    # A collected client's finalizer only tells its helper to end: the helper ends once it
    # runs again, which may be after this thread goes on.
    deadline = time.monotonic() + 60
    for helper in copy_helpers() - helpers_before:
        helper.join(max(0.0, deadline - time.monotonic()))
    assert copy_helpers() <= helpers_before, own_thread_names()


def copy_helpers() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "shm-copy"}


class _PageTablesStandIn:
    """Holds its copier, as the page tables do: the helper must not keep either alive."""

    def __init__(self) -> None:
        self.copier = SplitCopier(name="uptime-copy")
        self.prepared: list[int] = []

    def prepare(self, block: int) -> None:
        self.prepared.append(block)


def test_a_dropped_copier_ends_its_helper_after_copying() -> None:
    """The helper thread of a copier that split large copies ends once the copier and its
    owner are collected: the last job it took (whose ``prepare`` is the owner's) is not
    kept while it waits for the next one."""
    owner = _PageTablesStandIn()
    source = np.arange(8 << 20, dtype=np.uint8)
    target = np.zeros_like(source)
    piece = 1 << 20
    for _ in range(3):
        pieces = [
            (target[at : at + piece], source[at : at + piece], at // piece)
            for at in range(0, source.nbytes, piece)
        ]
        owner.copier.run(pieces, owner.prepare)
    assert np.array_equal(source, target)
    helpers = [thread for thread in threading.enumerate() if thread.name == "uptime-copy"]
    assert len(helpers) == 1
    collected = weakref.ref(owner)
    del owner, pieces
    gc.collect()
    assert collected() is None, "the helper thread keeps the copier's owner alive"
    helpers[0].join(60)
    assert not helpers[0].is_alive(), "the helper of a collected copier still waits for work"
