"""Counters of the RPC front end.

Plain integers bumped by the server's loop thread only (pool work reports back through the
loop), so the hot path takes no lock; the HTTP thread reads them at scrape time, where a
value one request stale is fine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerStats:
    requests: Counter[str] = field(default_factory=Counter)  # by op name
    failures: Counter[str] = field(default_factory=Counter)  # by reason
    stores: int = 0
    store_chunks: int = 0
    store_bytes: int = 0
    retrieves: int = 0
    retrieve_chunks: int = 0
    retrieve_bytes: int = 0
    # gauges, refreshed by the loop thread
    pending_prefetches: int = 0
    reserved_stores: int = 0
    locked_keys: int = 0
    pool_tasks: int = 0
    sessions: int = 0

    def failure(self, reason: str) -> None:
        self.failures[reason] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "failures": dict(self.failures),
            "stores": self.stores,
            "store_chunks": self.store_chunks,
            "store_bytes": self.store_bytes,
            "retrieves": self.retrieves,
            "retrieve_chunks": self.retrieve_chunks,
            "retrieve_bytes": self.retrieve_bytes,
            "in_flight": {
                "prefetches": self.pending_prefetches,
                "stores": self.reserved_stores,
                "pool_tasks": self.pool_tasks,
            },
            "locked_keys": self.locked_keys,
            "clients": self.sessions,
        }
