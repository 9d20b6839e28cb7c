"""``lookup_and_lock_now``: the composed adapter asking a backend's ``contains_many_now``
on the caller's thread, and every way that answer can fail to be usable."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from l2_backends import AsyncDictBackend, DictBackend, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys


class NowDict(DictBackend):
    """The dict backend with its index answered at once; ``answer`` can spoil it."""

    answer: Any = "index"

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> Any:
        self.__dict__.setdefault("now_threads", []).append(threading.current_thread())
        if self.answer == "index":
            return self.contains_many(keys)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class AsyncNowDict(AsyncDictBackend):
    def contains_many_now(self, keys: Sequence[ObjectKey]) -> Any:
        return [None] * len(keys)


def backend_of(adapter: L2Adapter) -> Any:
    return adapter.backend  # type: ignore[attr-defined]


def stored(
    adapters: list[L2Adapter], backend: type[DictBackend], count: int
) -> tuple[L2Adapter, list[ObjectKey]]:
    adapter = open_dict(backend)
    adapters.append(adapter)
    keys = make_keys(count)
    client = BlockingAdapterClient(adapter)
    assert client.store(keys[:1], [memoryview(b"x" * 100)]) == [True]
    return adapter, keys


def test_the_answer_is_the_callers_and_hits_are_pinned(adapters: list[L2Adapter]) -> None:
    adapter, keys = stored(adapters, NowDict, 2)
    result = adapter.lookup_and_lock_now(keys)
    assert result == ([True, False], [100, 0])
    assert backend_of(adapter).now_threads == [threading.current_thread()]
    assert adapter.pinned_keys() == {keys[0]: 1}  # type: ignore[attr-defined]
    assert adapter.delete(keys[:1]) == [False]
    adapter.unlock(keys[:1])
    stats = adapter.stats()
    assert stats["lookups_answered_now"] == 1 and stats.get("lookup_tasks", 0) == 0
    assert (stats["lookup_hits"], stats["lookup_misses"]) == (1, 1)


def test_not_now_holds_and_counts_nothing(adapters: list[L2Adapter]) -> None:
    adapter, keys = stored(adapters, NowDict, 2)
    backend_of(adapter).answer = None
    assert adapter.lookup_and_lock_now(keys) is None
    assert adapter.pinned_keys() == {}  # type: ignore[attr-defined]
    stats = adapter.stats()
    assert stats.get("lookups_answered_now", 0) == 0 and stats.get("backend_errors", 0) == 0


def test_a_raising_or_malformed_answer_falls_back_and_is_counted(adapters: list[L2Adapter]) -> None:
    adapter, keys = stored(adapters, NowDict, 2)
    backend = backend_of(adapter)
    for spoiled in (RuntimeError("index torn"), [100], [True, None], "junk"):
        backend.answer = spoiled
        assert adapter.lookup_and_lock_now(keys) is None
        assert adapter.pinned_keys() == {}  # type: ignore[attr-defined]
    assert adapter.stats()["backend_errors"] == 4
    # The worker thread still answers.
    assert BlockingAdapterClient(adapter).lookup_and_lock(keys).found == [True, False]
    adapter.unlock(keys[:1])


def test_keys_being_deleted_are_misses_without_asking(adapters: list[L2Adapter]) -> None:
    adapter, keys = stored(adapters, NowDict, 1)
    state = adapter.state  # type: ignore[attr-defined]
    assert state.pins.begin_delete(keys) == [True]
    try:
        assert adapter.lookup_and_lock_now(keys) == ([False], [0])
        assert "now_threads" not in backend_of(adapter).__dict__  # nothing left to ask
    finally:
        state.pins.end_delete(keys)


def test_backends_without_the_method_and_closed_adapters_answer_none(adapters: list[L2Adapter]) -> None:
    plain, keys = stored(adapters, DictBackend, 1)
    assert plain.lookup_and_lock_now(keys) is None
    adapter, keys = stored(adapters, NowDict, 1)
    adapter.close()
    assert adapter.lookup_and_lock_now(keys) is None
    assert "now_threads" not in backend_of(adapter).__dict__


def test_a_coroutine_backend_answers_on_the_callers_thread_too(adapters: list[L2Adapter]) -> None:
    adapter = open_dict(AsyncNowDict)
    adapters.append(adapter)
    assert adapter.lookup_and_lock_now(make_keys(2)) == ([False, False], [0, 0])


class CancellingNowDict(DictBackend):
    """An index answered by coroutines of its own: one cancelled by its client library
    reaches the caller as a CancelledError, not an Exception."""

    raised: BaseException = asyncio.CancelledError()

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> Any:
        raise self.raised


def test_a_cancelled_answer_falls_back_and_is_counted(adapters: list[L2Adapter]) -> None:
    adapter, keys = stored(adapters, CancellingNowDict, 2)
    assert adapter.lookup_and_lock_now(keys) is None
    assert adapter.pinned_keys() == {}  # type: ignore[attr-defined]
    assert adapter.stats()["backend_errors"] == 1
    # The worker's lookup still answers, and what it pins is given back by the caller.
    assert BlockingAdapterClient(adapter).lookup_and_lock(keys)[0] == [True, False]
    adapter.unlock(keys[:1])
    assert adapter.pinned_keys() == {}  # type: ignore[attr-defined]


def test_an_interrupt_in_the_answer_gives_the_pins_back(adapters: list[L2Adapter]) -> None:
    adapter, keys = stored(adapters, CancellingNowDict, 2)
    backend_of(adapter).raised = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        adapter.lookup_and_lock_now(keys)
    assert adapter.pinned_keys() == {}  # type: ignore[attr-defined]
    assert adapter.delete(keys[:1]) == [True]  # nothing left pinned or being read
