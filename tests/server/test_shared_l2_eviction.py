"""Two real servers sharing one L2 (Redis, S3 on SeaweedFS; ``fs`` refuses a directory another
server uses, so it is not a shared store), each
with a small ``max_capacity_gb`` so both evict, and with different L1 sizes: clients on
both store and read overlapping and disjoint prompts.  No wrong bytes ever; what one
server evicts while the other still accounts it is a counted vanished miss there, its
usage released; each server's usage stays within [0, its capacity]; salts keep tenants
apart; a server restarted while the other runs finds what the store holds."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from shared_stores import STARTERS, SharedStore
from tiers_e2e import ServerProcess, digest, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.testing.ports import free_ports

CHUNK = 256 << 10
BATCH = 4
CAPACITY_CHUNKS = 16
CAPACITY = CAPACITY_CHUNKS * CHUNK
#: a bound against hangs only; nothing asserts on timing
HANG_GUARD_S = 60.0
#: the eviction controller checks usage about once a second; this many passes settle it
EVICTION_WAIT_S = 30.0
#: the share of its capacity past which a server's eviction starts
TRIGGER_WATERMARK = 0.8


#: the stores whose shared eviction these tests run
STORES = {kind: STARTERS[kind] for kind in ("redis", "s3")}

#: the adapter field naming each test's own part of the store, and the separator after it
NAMESPACE_FIELD = {"redis": ("key_prefix", ":"), "s3": ("prefix", "")}


@pytest.fixture(scope="module", params=sorted(STORES))
def store_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, SharedStore]]:
    """One Redis or SeaweedFS for the module's tests (starting one takes seconds); each test
    works under a namespace of its own in it, so no test sees another's records."""
    with ExitStack() as stack:
        yield request.param, STORES[request.param](tmp_path_factory.mktemp(request.param), stack)


@pytest.fixture
def shared_store(store_service: tuple[str, SharedStore]) -> SharedStore:
    """One store both servers use: (the adapter object without capacity, the servers' env)."""
    kind, (adapter, env) = store_service
    field, separator = NAMESPACE_FIELD[kind]
    return {**adapter, field: f"shared-{uuid.uuid4().hex[:8]}{separator}"}, env


class Node:
    """One server of the pair, with what this test needs to ask it."""

    def __init__(self, log_dir: Path, store: SharedStore, l1_size_gb: float, ports: list[int]) -> None:
        """Start the server on ``ports`` (its RPC and metrics ports): the pair's four are
        picked together, so two servers starting at once cannot be given one port twice."""
        self.log_dir, (self.adapter, self.env), self.l1_size_gb = log_dir, store, l1_size_gb
        rpc_port, metrics_port = ports
        self.server: ServerProcess = self._start("", {"port": rpc_port, "metrics_port": metrics_port})

    def _start(self, suffix: str, ports: dict[str, Any] | None = None) -> ServerProcess:
        """Start a server on ``ports``, or on ports of its own when none are given."""
        config = {
            **self.adapter,
            "max_capacity_gb": CAPACITY / (1 << 30),
            "eviction": {
                "eviction_policy": "LRU",
                "trigger_watermark": TRIGGER_WATERMARK,
                "eviction_ratio": 0.25,
            },
        }
        return start_server(
            self.log_dir.with_name(self.log_dir.name + suffix),
            adapters=[config],
            env=self.env,
            l1_size_gb=self.l1_size_gb,
            **(ports or {}),
        )

    def start_again(self) -> None:
        self.server = self._start("-restarted")

    def wait_scan_done(self) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while self.adapter_status()["backend"].get("scan_running", 0):
            assert time.monotonic() < deadline, "the start-up listing never finished"
            time.sleep(0.1)

    def stop(self) -> None:
        assert self.server.stop() == 0, self.server.output()

    def adapter_status(self) -> dict[str, Any]:
        with Client(self.server.url, timeout=HANG_GUARD_S) as client:
            status: dict[str, Any] = client.status()["adapters"][0]
        return status

    def vanished(self) -> int:
        return int(self.adapter_status()["backend"].get("objects_vanished", 0))

    def flood_until_it_evicts(self) -> None:
        """Store new prompts until this server's eviction has run.  Past the watermark it
        waits instead: eviction runs on its own thread, about once a second, and a loaded
        machine may store many prompts before it does (or refuse them at capacity)."""
        evicted_before = int(self.adapter_status()["keys_evicted"])
        deadline = time.monotonic() + EVICTION_WAIT_S
        round_index = 0
        while True:
            status = self.adapter_status()
            if int(status["keys_evicted"]) > evicted_before:
                return
            assert time.monotonic() < deadline, f"no eviction at usage {status['used_bytes']} of {CAPACITY}"
            if int(status["used_bytes"]) < CAPACITY * TRIGGER_WATERMARK:
                self.store_through_l2(f"flood/{round_index}")
                round_index += 1
            else:
                time.sleep(0.2)

    def store_through_l2(self, tag: str, count: int = BATCH, salt: str = "") -> None:
        """Store chunks, wait until L2 settled them, then empty L1 so reads come from L2."""
        with Client(self.server.url, timeout=HANG_GUARD_S) as client:
            before = _settled(client)
            client.store(make_keys(tag, count, salt=salt), make_payloads(f"{salt}/{tag}", count, CHUNK))
            deadline = time.monotonic() + HANG_GUARD_S
            while _settled(client) < before + count:
                assert time.monotonic() < deadline, "the store controller never settled the chunks"
                time.sleep(0.05)
            client.clear()

    def read_checked(self, tag: str, count: int = BATCH, salt: str = "") -> int:
        """Look up and retrieve; fail on any wrong byte; return the hits."""
        keys = make_keys(tag, count, salt=salt)
        with Client(self.server.url, timeout=HANG_GUARD_S) as client:
            hits = client.lookup(keys)
            with client.retrieve(keys[:hits]) as views:
                got = digest(views)
            client.clear()
        assert got == digest(make_payloads(f"{salt}/{tag}", count, CHUNK))[:hits], f"wrong bytes for {tag!r}"
        return hits

    def wait_usage_within_capacity(self) -> int:
        """Until eviction brought this server's usage within its capacity; returns it."""
        deadline = time.monotonic() + EVICTION_WAIT_S
        while True:
            used = int(self.adapter_status()["used_bytes"])
            assert used >= 0, f"negative usage {used}"
            if used <= CAPACITY:
                return used
            assert time.monotonic() < deadline, f"usage {used} never came back within {CAPACITY}"
            time.sleep(0.2)


def _settled(client: Client) -> int:
    adapter = client.status()["adapters"][0]
    return int(adapter["keys_stored"]) + int(adapter["keys_store_failed"])


@pytest.fixture
def pair(tmp_path: Path, shared_store: SharedStore) -> Iterator[tuple[Node, Node]]:
    """Two servers of different L1 sizes on the shared store.  They start and stop at the
    same time: each start or stop waits on its own process, and one after the other the
    pair's set-up and teardown took twice as long for nothing the tests check."""
    ports = free_ports(4)
    l1_sizes = {"small-l1": 0.0625, "large-l1": 0.25}
    with ThreadPoolExecutor(len(l1_sizes)) as pool, ExitStack() as stack:
        starts = [
            pool.submit(Node, tmp_path / name, shared_store, l1_size_gb, ports[2 * index : 2 * index + 2])
            for index, (name, l1_size_gb) in enumerate(l1_sizes.items())
        ]
        stack.callback(_stop_all, pool, starts)  # also the one that started if the other failed
        small, large = (start.result() for start in starts)
        yield small, large


def _stop_all(pool: ThreadPoolExecutor, starts: list[Future[Node]]) -> None:
    """Stop every node that started, at the same time; a node that did not stop cleanly
    fails the test once all were stopped."""
    started = [start.result() for start in starts if start.exception() is None]
    stops = [pool.submit(node.stop) for node in started]
    for stop in stops:
        stop.result()


def test_both_evict_and_never_hand_out_wrong_bytes(pair: tuple[Node, Node]) -> None:
    small, large = pair
    for round_index in range(CAPACITY_CHUNKS // BATCH * 3):  # three capacities each
        small.store_through_l2("overlap")  # both keep storing one prompt
        large.store_through_l2("overlap")
        small.store_through_l2(f"small/{round_index}")
        large.store_through_l2(f"large/{round_index}")
        for node in (small, large):
            node.read_checked("overlap")
            node.read_checked(f"small/{round_index}")
            node.read_checked(f"large/{round_index}")
    for node in (small, large):
        for round_index in range(CAPACITY_CHUNKS // BATCH * 3):
            node.read_checked(f"small/{round_index}")
            node.read_checked(f"large/{round_index}")
        node.wait_usage_within_capacity()


def test_a_record_the_other_evicted_is_a_counted_vanished_miss(pair: tuple[Node, Node]) -> None:
    small, large = pair
    small.store_through_l2("victim")
    large.store_through_l2("victim")  # accounted by both servers
    used_before = int(small.adapter_status()["used_bytes"])
    assert used_before > 0
    # Large's LRU evicts the oldest prompt first; only small reads it, so large's recency
    # of it stays the oldest: large's first eviction takes it from the store.
    large.flood_until_it_evicts()
    assert small.read_checked("victim") < BATCH, "large's eviction left its oldest prompt"
    assert small.vanished() >= 1, "the miss of an accounted record is counted as vanished"
    assert int(small.adapter_status()["used_bytes"]) < used_before, "the vanished bytes left small's usage"
    small.wait_usage_within_capacity()
    large.wait_usage_within_capacity()


def test_salts_keep_tenants_apart(pair: tuple[Node, Node]) -> None:
    small, large = pair
    small.store_through_l2("prompt", salt="tenant-a")
    large.store_through_l2("prompt", salt="tenant-b")
    for reader in (small, large):
        assert reader.read_checked("prompt", salt="tenant-a") == BATCH
        assert reader.read_checked("prompt", salt="tenant-b") == BATCH
        assert reader.read_checked("prompt", salt="tenant-c") == 0


def test_a_restarted_server_finds_what_the_store_holds(pair: tuple[Node, Node]) -> None:
    small, large = pair
    small.store_through_l2("before-restart")
    large.store_through_l2("from-large")
    small.stop()
    large.store_through_l2("while-small-was-away")
    small.start_again()
    small.wait_scan_done()
    assert small.adapter_status()["backend"]["scan_keys"] == 3 * BATCH, "it listed what the store holds"
    for tag in ("before-restart", "from-large", "while-small-was-away"):
        assert small.read_checked(tag) == BATCH, tag
    for round_index in range(CAPACITY_CHUNKS // BATCH * 2):
        small.store_through_l2(f"after/{round_index}")
        large.read_checked(f"after/{round_index}")
    small.wait_usage_within_capacity()
    large.wait_usage_within_capacity()
