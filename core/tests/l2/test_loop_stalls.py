"""A coroutine backend that blocks its event loop is counted as `loop_stalls` and named
at the line it blocks at; one that awaits, however long, is not."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import pytest
from l2_backends import AsyncDictBackend, keys_of, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, ObjectSize
from lmcache_tiers.l2.loop_watch import LoopWatch, held_at
from lmcache_tiers.testing.blocking import BlockingAdapterClient

#: how long the backends below take over one lookup: several stall limits (as shortened
#: below), so a watch thread slowed by a loaded machine still sees the stall
HOLD_S = 2.0


class BlockingLookups(AsyncDictBackend):
    """A lookup that makes a synchronous call inside its coroutine."""

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:  # type: ignore[override]
        time.sleep(HOLD_S)  # the blocking call the watch must name
        return await super().contains_many(keys)


class AwaitingLookups(AsyncDictBackend):
    """A lookup just as slow, that awaits: the loop runs other calls meanwhile."""

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:  # type: ignore[override]
        await asyncio.sleep(HOLD_S)
        return await super().contains_many(keys)


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LoopWatch, "CHECK_S", 0.05)
    monkeypatch.setattr(LoopWatch, "STALL_S", 0.3)


def test_a_coroutine_blocking_its_loop_is_counted_once_and_named(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = open_dict(BlockingLookups)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    with caplog.at_level(logging.INFO, logger="lmcache_tiers.l2"):
        assert client.lookup_and_lock(keys_of("m", 2)).found == [False, False]
        assert client.lookup_and_lock(keys_of("m", 1)).found == [False]  # after the stall
    assert adapter.stats()["loop_stalls"] == 2, "one stall per blocking lookup"
    stalls = [r.getMessage() for r in caplog.records if "its event loop has run nothing" in r.getMessage()]
    assert stalls, caplog.text
    assert f"{__file__}:" in stalls[0] and "in contains_many" in stalls[0], stalls[0]
    assert "(loop_stalls)" in stalls[0]
    assert any("its event loop runs again" in r.getMessage() for r in caplog.records), caplog.text


def test_a_coroutine_that_awaits_is_never_a_stall(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(AwaitingLookups)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    assert client.lookup_and_lock(keys_of("m", 2)).found == [False, False]
    time.sleep(LoopWatch.STALL_S * 2)  # idle: the loop waits in its selector
    assert adapter.stats().get("loop_stalls", 0) == 0


def test_the_watch_ends_with_its_adapter(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(AsyncDictBackend)
    watch = adapter.runner._watch  # type: ignore[attr-defined]
    assert watch._thread.is_alive()
    adapter.close()
    assert not watch._thread.is_alive()


def test_a_thread_with_no_python_frame_is_not_held() -> None:
    assert held_at(None) is None
