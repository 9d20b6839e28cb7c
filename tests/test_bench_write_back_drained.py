"""server_store's STORE under write-back reports how long L2 took to take everything only
once L2 is known to hold every key stored: "no L2 store pending" is also what a
write-back that dropped or failed some of them leaves, and its figures would then be of
bytes L2 never took."""

from __future__ import annotations

from typing import Any

import pytest
from bench_modules import load_bench

from lmcache_tiers.keys import ObjectKey


class TwoTierClient:
    """A server with nothing pending in L2 whose L2 took every stored key but the
    ``lost`` first of each STORE.  L1 answers lookups first, so only a lookup of keys
    evicted from L1 tells what L2 holds."""

    lost = 0

    def __init__(self, url: str, timeout: float, name: str) -> None:
        self.l1: set[ObjectKey] = set()
        self.l2: set[ObjectKey] = set()
        self.locked: set[ObjectKey] = set()

    def __enter__(self) -> TwoTierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {
            "store": {"in_flight_tasks": 0, "pending_batches": 0},
            "failures": {"l2_store_failed": self.lost} if self.lost else {},
        }

    def store(self, keys: list[ObjectKey], sources: list[Any], l1_only: bool = False) -> int:
        self.l1.update(keys)
        if not l1_only:
            self.l2.update(keys[self.lost :])
        return len(keys)

    def evict(self, keys: list[ObjectKey]) -> int:
        gone = self.l1.intersection(keys) - self.locked
        self.l1 -= gone
        return len(gone)

    def lookup(self, keys: list[ObjectKey], timeout: float | None = None) -> int:
        hits = 0
        for key in keys:
            if key not in self.l1 | self.l2:
                break
            hits += 1
        self.l1.update(keys[:hits])  # an L2 hit is prefetched into L1
        self.locked.update(keys[:hits])
        return hits

    def release(self, keys: list[ObjectKey], timeout: float | None = None) -> int:
        released = self.locked.intersection(keys)
        self.locked -= released
        return len(released)


def test_a_write_back_that_left_keys_out_of_l2_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    server_store = load_bench("server_store")
    monkeypatch.setattr(TwoTierClient, "lost", 1)
    monkeypatch.setattr(server_store, "Client", TwoTierClient)
    with pytest.raises(SystemExit, match=r"L2 held 0 of 3 .*l2_store_failed"):
        server_store.store_under_write_back("tcp://x", chunks=3, chunk_bytes=4096, repeats=2)


def test_a_write_back_that_stored_everything_is_reported_and_leaves_nothing_locked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server_store = load_bench("server_store")
    clients: list[TwoTierClient] = []

    def client(*args: Any, **kwargs: Any) -> TwoTierClient:
        clients.append(TwoTierClient(*args, **kwargs))
        return clients[-1]

    monkeypatch.setattr(server_store, "Client", client)
    figures = server_store.store_under_write_back("tcp://x", chunks=3, chunk_bytes=4096, repeats=2)
    assert figures.write_back_gbps > 0
    (used,) = clients
    assert len(used.l2) == 2 * 3 and not used.locked and not used.l1
