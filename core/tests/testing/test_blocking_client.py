"""``BlockingAdapterClient``: giving up on a task never costs another task its result."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Op, LookupResult
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2_support import make_keys


class HeldLookups:
    """The adapter surface the client uses; lookups complete when the test says so."""

    name = "0:held"

    def __init__(self) -> None:
        self.fds = {op: os.eventfd(0, os.EFD_NONBLOCK) for op in L2Op}
        self.submitted: dict[int, list[ObjectKey]] = {}
        self.completed: dict[int, LookupResult] = {}
        self.unlocked: list[ObjectKey] = []

    def event_fd(self, op: L2Op) -> int:
        return self.fds[op]

    def submit_lookup_and_lock(self, keys: Sequence[ObjectKey]) -> int:
        task_id = len(self.submitted) + 1
        self.submitted[task_id] = list(keys)
        return task_id

    def complete(self, task_id: int) -> None:
        keys = self.submitted[task_id]
        self.completed[task_id] = LookupResult([True] * len(keys), [10] * len(keys))
        os.eventfd_write(self.fds[L2Op.LOOKUP], 1)

    def pop_completed_lookups(self) -> dict[int, LookupResult]:
        try:
            os.eventfd_read(self.fds[L2Op.LOOKUP])
        except BlockingIOError:
            pass
        popped, self.completed = self.completed, {}
        return popped

    def pop_completed_stores(self) -> dict[int, Any]:
        return {}

    def pop_completed_loads(self) -> dict[int, Any]:
        return {}

    def unlock(self, keys: Sequence[ObjectKey]) -> None:
        self.unlocked.extend(keys)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@pytest.fixture
def adapter() -> Any:
    held = HeldLookups()
    yield held
    held.close()


def test_a_lookup_given_up_without_its_keys_leaves_other_results_alone(adapter: HeldLookups) -> None:
    client = BlockingAdapterClient(adapter, timeout=5)  # type: ignore[arg-type]
    keys = make_keys(2)
    abandoned = adapter.submit_lookup_and_lock(keys)
    with pytest.raises(TimeoutError):
        client.wait(L2Op.LOOKUP, abandoned, timeout=0.01)  # no keys: its pins cannot be dropped
    waited = adapter.submit_lookup_and_lock(keys)
    adapter.complete(abandoned)
    adapter.complete(waited)
    assert client.wait(L2Op.LOOKUP, waited) == ([True, True], [10, 10])
    assert adapter.unlocked == []  # not the keys of a task it was never told


def test_a_lookup_given_up_with_its_keys_drops_its_pins(adapter: HeldLookups) -> None:
    client = BlockingAdapterClient(adapter, timeout=5)  # type: ignore[arg-type]
    keys = make_keys(2)
    abandoned = adapter.submit_lookup_and_lock(keys)
    with pytest.raises(TimeoutError):
        client.wait(L2Op.LOOKUP, abandoned, timeout=0.01, keys=keys)
    waited = adapter.submit_lookup_and_lock(keys[:1])
    adapter.complete(abandoned)
    adapter.complete(waited)
    assert client.wait(L2Op.LOOKUP, waited) == ([True], [10])
    assert adapter.unlocked == keys
