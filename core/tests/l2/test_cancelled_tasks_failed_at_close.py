"""Tasks of a coroutine backend that the adapter's close cancels -- a call still running
at the close deadline, and the tasks queued behind it for the backend's concurrency --
fail and count as ``tasks_failed_closed``, as the tasks a plain backend's close fails do."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from l2_backends import AsyncDictBackend, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.threads import DEADLINE_S, wait_until


class HungStores(AsyncDictBackend):
    """One call at a time; ``put_many`` never returns by itself."""

    concurrency = 1

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.entered = threading.Event()

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        self.entered.set()
        await asyncio.Event().wait()
        return [True] * len(keys)


def test_tasks_cancelled_by_the_close_are_counted(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = open_dict(HungStores)
    adapters.append(adapter)
    adapter.close_timeout_s = 0.2  # type: ignore[misc]
    backend = adapter.backend
    assert isinstance(backend, HungStores)
    keys = make_keys(3)
    running = adapter.submit_store(keys[:1], [memoryview(bytes(100))])
    assert backend.entered.wait(DEADLINE_S), "the first store reached the backend"
    queued = [adapter.submit_store([key], [memoryview(bytes(100))]) for key in keys[1:]]
    # The close cancels the tasks, then fails (and counts) those still pending: the loop
    # has ended each cancelled task first here, so none is left for that sweep.
    scan_join = adapter.scan.join

    def join_once_the_cancelled_tasks_ended(deadline: float) -> None:
        wait_until(lambda: adapter.state.board.pending_count() == 0, "the cancelled tasks to end")
        scan_join(deadline)

    monkeypatch.setattr(adapter.scan, "join", join_once_the_cancelled_tasks_ended)

    adapter.close()

    results = adapter.pop_completed_stores()
    assert set(results) == {running, *queued}, "every task was answered"
    assert all(result == [False] for result in results.values())
    stats = adapter.stats()
    assert stats.get("tasks_failed_closed") == 1 + len(queued), stats
    assert stats["pending_tasks"] == 0
