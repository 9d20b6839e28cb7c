"""Helpers of the long-uptime tests (tests/server/test_long_uptime.py): one round of client
churn against a server, and what a process holds (file descriptors, threads, mappings)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

from tiers_e2e import ServerProcess, fetch, job_vanish_holding_locks, make_keys, make_payloads

from lmcache_tiers.client import Client
from lmcache_tiers.wire.protocol import StoreReserve, StoreReserveReply

CHUNK_BYTES = 4096
#: what the server's clients may still hold once every TTL has run out: nothing
HELD_GAUGES = (
    "lmcache_tiers_client_locked_keys",
    "lmcache_tiers_l1_read_locks",
    "lmcache_tiers_l1_write_locked",
    'lmcache_tiers_in_flight{kind="client_prefetches"}',
    'lmcache_tiers_in_flight{kind="client_stores"}',
)


@dataclass(frozen=True)
class Holdings:
    """What a process holds at one moment."""

    fds: int
    threads: int
    segment_maps: int  # mappings of the L1 segment

    @classmethod
    def of(cls, pid: int, shm_name: str) -> Holdings:
        with open(f"/proc/{pid}/maps") as maps:
            segment_maps = sum(shm_name in line for line in maps)
        return cls(
            fds=len(os.listdir(f"/proc/{pid}/fd")),
            threads=len(os.listdir(f"/proc/{pid}/task")),
            segment_maps=segment_maps,
        )

    def grown_past(self, earlier: Holdings, slack: int) -> list[str]:
        """The measures that grew by more than ``slack`` since ``earlier``."""
        return [
            f"{name}: {before} -> {after}"
            for name, before, after in (
                ("fds", earlier.fds, self.fds),
                ("threads", earlier.threads, self.threads),
                ("L1 segment mappings", earlier.segment_maps, self.segment_maps),
            )
            if after > before + slack
        ]


def one_client(url: str, tag: str, index: int) -> None:
    """A short-lived engine connection: stores a little, looks it up, then either reads it,
    leaves a prefetch uncollected or a reservation uncommitted; every fifth one (with or
    without shared memory) is dropped without ``close`` (its read locks and reservation left to the TTLs)."""
    client = Client(url, shm=index % 2 == 0, timeout=30)
    keys = make_keys(f"{tag}/{index}", 2)
    client.store(keys, make_payloads(f"{tag}/{index}", 2, CHUNK_BYTES))
    hits = client.lookup(keys)
    kind = index % 3
    if kind == 0:
        with client.retrieve(keys[:hits]):
            pass
    elif kind == 1:
        client.start_lookup(make_keys(f"{tag}/absent{index}", 2))  # never collected
    else:
        reserve = StoreReserve(0, "", make_keys(f"{tag}/uncommitted{index}", 1), [CHUNK_BYTES])
        client._call(reserve, StoreReserveReply)  # never committed
    if index % 5 != 4:
        client.close()


def churn_round(server: ServerProcess, tag: str, clients: int) -> None:
    """``clients`` short-lived connections from this process, then one client process that
    dies holding read locks and a reservation."""
    for index in range(clients):
        one_client(server.url, tag, index)
    vanishing = multiprocessing.get_context("spawn").Process(
        target=job_vanish_holding_locks, args=(server.url, f"{tag}/0", 2)
    )
    vanishing.start()
    vanishing.join(60)
    assert vanishing.exitcode == 0, f"the vanishing client ended with {vanishing.exitcode}"
    gc.collect()  # the dropped clients are garbage now, as they would be in an engine


def held_by_clients(server: ServerProcess) -> dict[str, float]:
    assert server.http_url is not None
    _, _, text = fetch(server.http_url + "/metrics")
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in HELD_GAUGES:
            values[name] = float(value)
    return values


def wait_until_nothing_held(server: ServerProcess, timeout: float = 60.0) -> None:
    """Wait until the TTLs have taken back whatever the round's clients left behind."""
    deadline = time.monotonic() + timeout
    while any(held_by_clients(server).values()):
        assert time.monotonic() < deadline, f"still held after the TTLs: {held_by_clients(server)}"
        time.sleep(0.2)


def own_thread_names() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())
