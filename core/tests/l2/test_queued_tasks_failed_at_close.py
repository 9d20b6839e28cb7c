"""Tasks still queued on a plain backend's worker threads when the adapter closes never
reach the backend: each is failed and counted as ``tasks_failed_closed``, as the tasks
the close fails elsewhere are (the event loop's, those submitted after the close began)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from l2_backends import DictBackend, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.threads import DEADLINE_S


class HeldStores(DictBackend):
    """``put_many`` waits until ``interrupt`` (the adapter's close) lets it return."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.entered = threading.Event()
        self.released = threading.Event()

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self.entered.set()
        self.released.wait(DEADLINE_S)
        return [False] * len(keys)

    def interrupt(self) -> None:
        self.released.set()


def test_tasks_queued_behind_a_running_store_are_counted_when_close_fails_them(
    adapters: list[BackendAdapter],
) -> None:
    adapter = open_dict(HeldStores)
    adapters.append(adapter)
    backend = adapter.backend
    assert isinstance(backend, HeldStores)
    keys = make_keys(4)
    buffers = [memoryview(bytes(100)) for _ in keys]
    running = adapter.submit_store(keys[:1], buffers[:1])
    assert backend.entered.wait(DEADLINE_S), "the first store reached the backend"
    queued = [
        adapter.submit_store([key], [buffer]) for key, buffer in zip(keys[1:], buffers[1:], strict=True)
    ]

    adapter.close()

    results = adapter.pop_completed_stores()
    assert set(results) == {running, *queued}, "every task was answered"
    assert all(results[task] == [False] for task in queued)
    stats = adapter.stats()
    assert stats.get("tasks_failed_closed") == len(queued), stats
    assert stats["pending_tasks"] == 0
