"""L2 eviction while the adapter's circuit breaker is open (its backend down).

The circuit refuses every delete without calling the backend; an eviction cycle issuing
them anyway would count each refusal as a failed delete, about ``DELETE_BATCH`` a
second for as long as the backend is down -- deletes never attempted.  The cycle is
skipped instead, counted once, and eviction resumes when a probe closes the circuit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from l2_backends import DictBackend, Fifo, open_dict, store_blank

from lmcache_tiers.config import CircuitConfig, L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter

SIZE = 1000
OBJECTS = 200
WAIT_S = 30.0  # guards against hangs only
THRESHOLD = 3


class Reachability:
    """Whether the store answers: while down, every call raises, as a lost connection does."""

    def __init__(self) -> None:
        self.down = threading.Event()

    def check(self) -> None:
        if self.down.is_set():
            raise ConnectionError("store unreachable")


NETWORK = Reachability()


class RemoteStore(DictBackend):
    """A dict behind a network that can go down (the circuit breaker guards remote ones)."""

    remote = True

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        NETWORK.check()
        return super().put_many(keys, payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        NETWORK.check()
        return super().contains_many(keys)

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        NETWORK.check()
        self._called("delete_many")
        return super().delete_many(keys)

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        NETWORK.check()
        return super().list_keys()


@pytest.fixture
def adapter() -> Iterator[BackendAdapter]:
    global NETWORK
    NETWORK = Reachability()
    opened = open_dict(
        RemoteStore,
        capacity=OBJECTS * SIZE,
        circuit=CircuitConfig(failure_threshold=THRESHOLD, probe_interval_s=0.02),
    )
    yield opened
    opened.close()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def filled_past_the_watermark(adapter: BackendAdapter) -> L2EvictionController:
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    controller = L2EvictionController(AdapterSlot(0, "remote", adapter), Fifo(), config, EngineStats(1))
    controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
    keys = [ObjectKey("circuit-model", 0, index.to_bytes(8, "big")) for index in range(OBJECTS)]
    store_blank(adapter, keys, SIZE)
    assert adapter.usage() == 1.0
    return controller


def open_the_circuit(adapter: BackendAdapter) -> None:
    NETWORK.down.set()
    victim = ObjectKey("circuit-model", 1, b"unstored")
    for _ in range(THRESHOLD):  # failed calls in a row open it
        assert adapter.delete([victim]) == [False]
    assert adapter.stats()["circuit_open"] == 1


def test_eviction_skips_its_cycles_while_the_circuit_is_open_and_resumes_after(
    adapter: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    controller = filled_past_the_watermark(adapter)
    open_the_circuit(adapter)
    refused_before = adapter.stats().get("circuit_failed_delete_keys", 0)
    cycles = 3

    for _ in range(cycles):
        controller.step(set())

    failures = controller.stats.failures()
    assert "l2_eviction_delete_failed" not in failures, "no delete was attempted: none failed"
    assert adapter.stats().get("circuit_failed_delete_keys", 0) == refused_before, (
        "no delete is issued for the circuit to refuse"
    )
    assert failures["l2_eviction_skipped_circuit_open"] == cycles, "every skipped cycle is counted"
    logged = [r for r in caplog.records if "circuit" in r.getMessage() and "eviction" in r.getMessage()]
    assert 1 <= len(logged) < cycles, "the skip is logged, once per burst"
    assert adapter.usage() == 1.0, "nothing was deleted"

    NETWORK.down.clear()
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "a probe to close the circuit")
    controller.step(set())

    assert adapter.usage() < 0.8, "eviction resumes once the backend answers again"
    assert controller.stats.failures()["l2_eviction_skipped_circuit_open"] == cycles
    assert "l2_eviction_delete_failed" not in controller.stats.failures()


def test_seeding_waits_for_the_circuit_to_close_and_then_lists_what_was_stored_before(
    adapter: BackendAdapter,
) -> None:
    # Stored before the controller listens: only the listing tells its policy about them.
    keys = [ObjectKey("circuit-model", 2, index.to_bytes(8, "big")) for index in range(OBJECTS)]
    store_blank(adapter, keys, SIZE)
    open_the_circuit(adapter)
    policy = Fifo()
    config = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.2)
    controller = L2EvictionController(AdapterSlot(0, "remote", adapter), policy, config, EngineStats(1))

    controller.step(set())

    failures = controller.stats.failures()
    assert "l2_eviction_scan_error" not in failures, "the listing is not sent to a backend known down"
    assert failures["l2_eviction_seed_deferred_circuit_open"] == 1, "the deferred seeding is counted"
    assert not policy.order, "nothing was listed yet"

    NETWORK.down.clear()
    wait_for(lambda: adapter.stats()["circuit_open"] == 0, "a probe to close the circuit")
    controller.step(set())

    assert adapter.usage() < 0.8, "keys stored before start-up are evicted: not full for good"
    assert "l2_eviction_scan_error" not in controller.stats.failures()
