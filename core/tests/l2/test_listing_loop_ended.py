"""An async key listing reading on an adapter's event loop that ends by an exception (a
callback of the backend's raising SystemExit on it) fails at once, counted for that
reason -- not after the stall limit, counted as a stall that never was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import pytest
from l2_backends import WAIT_BOUND_S, end_the_loop, keys_of, off_the_main_thread, running_loop_runner

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.runners import Runner

T = TypeVar("T")

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class ListingThatEndsItsLoop:
    """A coroutine backend whose listing gives one entry, then ends its loop and waits for
    an entry that never comes."""

    async def list_keys(self) -> AsyncIterator[tuple[Any, int]]:
        yield keys_of("listed", 1)[0], 100
        end_the_loop()
        await asyncio.get_running_loop().create_future()
        yield keys_of("listed", 2)[1], 100  # never reached


def test_an_async_listing_whose_loop_ends_fails_at_once_counted_as_such(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A stall limit far past the wait here: only the loop's end can answer the reader.
    monkeypatch.setattr(Runner, "listing_stall_timeout_s", WAIT_BOUND_S * 100)
    adapter, runner = running_loop_runner(adapters, ListingThatEndsItsLoop())
    batches: list[list[Any]] = []

    def read() -> None:
        for batch in runner.listing(1):
            batches.append(batch)

    with pytest.raises(Exception, match="event loop ended"):
        off_the_main_thread(read)
    assert len(batches) == 1, "the entry before the loop's end was read"
    stats = adapter.stats()
    assert stats["listings_failed_loop_ended"] == 1
    assert stats.get("listing_stalls", 0) == 0
    assert any("key listing failed" in r.getMessage() for r in caplog.records)

    # A listing begun once the loop is gone fails at once the same way.
    runner._thread.join(WAIT_BOUND_S)
    with pytest.raises(Exception, match="event loop ended"):
        off_the_main_thread(lambda: list(runner.listing(1)))
    assert adapter.stats()["listings_failed_loop_ended"] == 2
