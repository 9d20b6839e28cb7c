"""A listing that stops yielding (a peer or a mount that hangs rather than fails): a
coroutine backend's async iterator, or a plain backend's list_keys.

Both readers of a listing wait for its next batch on a thread of their own: the start-up
scan, which refuses stores that add bytes while it runs, and the eviction policy's seeding.
An entry that never comes must end the listing after ``listing_stall_timeout_s`` --
counted as ``listing_stalls`` and logged -- or the scan would refuse those stores for as
long as the adapter is open, and every retried seeding would leave one more thread
waiting for good.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from l2_backends import (
    AsyncDictBackend,
    DictBackend,
    keys_of,
    namespace_holding,
    open_dict,
    store_blank,
    wait_until,
)

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, L2Adapter
from lmcache_tiers.l2.runners import LoopRunner, Runner

BOUND_S = 30.0  # how long a test waits for what must happen; never a measure of speed
LISTED = 3


class StallingListing(AsyncDictBackend):
    """Lists its first entry, then waits for a next one that never comes (until cancelled)."""

    started = 0
    open_listings = 0  # listings begun and not yet ended (their generator still open)
    lock = threading.Lock()

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        with StallingListing.lock:
            StallingListing.started += 1
            StallingListing.open_listings += 1
        try:
            yield DictBackend.list_keys(self)[0]
            await asyncio.get_running_loop().create_future()  # the peer stopped answering
        finally:
            with StallingListing.lock:
                StallingListing.open_listings -= 1


def listing_over(backend: type[AsyncDictBackend], entries: int, adapters: list[L2Adapter]) -> BackendAdapter:
    """An adapter of ``backend`` over ``entries`` objects already stored (by a plain backend
    on the same namespace, so that ``backend``'s start-up scan is what lists them)."""
    namespace = namespace_holding(keys_of("listed", entries), 1000)
    adapter = open_dict(backend, capacity=100_000, namespace=namespace)
    adapters.append(adapter)
    return adapter


@pytest.fixture
def stalling(adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch) -> Iterator[BackendAdapter]:
    """An adapter over LISTED objects whose listing stalls after the first, with a deadline
    short enough for a test: the first entry is accounted in the foreground, and the scan's
    thread then waits for the rest."""
    import lmcache_tiers.l2.scan as scan

    StallingListing.started = StallingListing.open_listings = 0
    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 1)
    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(LoopRunner, "listing_stall_timeout_s", 0.2)
    yield listing_over(StallingListing, LISTED, adapters)


class SlowListing(AsyncDictBackend):
    """Lists every entry, each after a pause well within the deadline: a live store that
    is slow (a page per request, a header read per record), not a hung one."""

    pause_s = 0.0

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        for entry in DictBackend.list_keys(self):
            await asyncio.sleep(SlowListing.pause_s)
            yield entry


def test_a_stalled_listing_ends_the_scan_so_stores_are_no_longer_refused(
    stalling: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    wait_until(lambda: not stalling.stats()["scan_running"], "the end of the start-up scan")
    stats = stalling.stats()
    assert stats["listing_stalls"] == 1
    assert stats["scan_errors"] == 1
    assert stats["scan_keys"] == 1, "what was listed before the stall stays accounted"
    store_blank(stalling, keys_of("after", 1), 1000)  # no longer refused as "scanning"
    assert any("listing" in r.getMessage() and "stalled" in r.getMessage() for r in caplog.records)
    wait_until(lambda: StallingListing.open_listings == 0, "the stalled listing being closed")


def test_a_stalled_listing_is_cancelled_on_the_loop_not_failed_there(
    stalling: BackendAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    """The wait given up on is cancelled: the loop's task ends cancelled, not failed with
    the cancellation passed off as the plugin's own error -- a failure nobody reads, which
    asyncio reports at ERROR ("Task exception was never retrieved") for every stall."""
    wait_until(lambda: not stalling.stats()["scan_running"], "the end of the start-up scan")
    wait_until(lambda: StallingListing.open_listings == 0, "the stalled listing being closed")
    with pytest.raises(TimeoutError):
        list(stalling.iter_keys())
    wait_until(lambda: StallingListing.open_listings == 0, "the second stalled listing being closed")
    gc.collect()  # a failed task nobody read is reported when it is collected
    unread = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not unread, unread


def test_retried_listings_of_a_stalled_backend_leave_no_listing_behind(stalling: BackendAdapter) -> None:
    """Each reading of the keys (as the eviction policy's seeding retries them) fails past
    the deadline and closes its listing: none is left waiting on a thread."""
    wait_until(lambda: not stalling.stats()["scan_running"], "the end of the start-up scan")
    failures: list[BaseException] = []

    def read_keys() -> None:
        try:
            list(stalling.iter_keys())
        except Exception as exc:
            failures.append(exc)

    for _ in range(3):
        reader = threading.Thread(target=read_keys, daemon=True)
        reader.start()
        reader.join(BOUND_S)
        assert not reader.is_alive(), "reading the keys waits for good for a batch that never comes"
    assert [type(exc) for exc in failures] == [TimeoutError] * 3
    wait_until(lambda: StallingListing.open_listings == 0, "every stalled listing being closed")
    assert StallingListing.started == 4  # the scan's and three readings
    assert stalling.stats()["listing_stalls"] == 4


def test_a_slow_but_live_listing_is_not_taken_for_a_stalled_one(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline is for a listing that stopped answering: one whose entries keep coming
    (each well within it) is read to its end, however long its batch of entries takes."""
    deadline_s = 0.5
    monkeypatch.setattr(LoopRunner, "listing_stall_timeout_s", deadline_s)
    SlowListing.pause_s = deadline_s / 10
    entries = 30  # one batch: its entries take about 3 deadlines, each a tenth of one
    adapter = listing_over(SlowListing, entries, adapters)
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    assert len(list(adapter.iter_keys())) == entries
    stats = adapter.stats()
    assert stats.get("listing_stalls", 0) == 0
    assert stats.get("scan_errors", 0) == 0
    assert stats["scan_keys"] == entries


class TimingOutListing(AsyncDictBackend):
    """Lists its first entry, then fails with a TimeoutError of its own (a request to the
    peer that timed out, as ``asyncio.timeout`` raises)."""

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        yield DictBackend.list_keys(self)[0]
        raise TimeoutError("the peer did not answer the page request")


def test_a_listings_own_timeout_error_fails_it_at_once_not_as_a_stall(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TimeoutError the backend's listing raises is its failure, like any error: the scan
    ends counting a scan error -- not waiting, asking again and again, for an answer it
    already has until the stall limit passes and a stall that never was is counted."""
    import lmcache_tiers.l2.scan as scan

    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 1)
    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(Runner, "listing_stall_timeout_s", BOUND_S * 2)  # never reached here
    adapter = listing_over(TimingOutListing, LISTED, adapters)
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    stats = adapter.stats()
    assert stats["scan_errors"] == 1
    assert stats.get("listing_stalls", 0) == 0
    assert stats["scan_keys"] == 1


# -- a synchronous list_keys that hangs ----------------------------------------------------


class HangingListing(DictBackend):
    """A plain backend whose ``list_keys`` lists its first entry, then hangs in storage
    (a directory on a hung mount) until ``released`` is set: nothing can cancel it."""

    released = threading.Event()

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        yield DictBackend.list_keys(self)[0]
        HangingListing.released.wait(BOUND_S)


class HangingListCall(DictBackend):
    """A plain backend whose ``list_keys`` call itself never returns its list."""

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        HangingListing.released.wait(BOUND_S)
        return DictBackend.list_keys(self)


@pytest.mark.parametrize("backend", [HangingListing, HangingListCall], ids=["generator", "list"])
def test_a_hung_synchronous_listing_ends_the_scan_so_stores_are_no_longer_refused(
    backend: type[DictBackend],
    adapters: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import lmcache_tiers.l2.scan as scan

    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 1)
    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(Runner, "listing_stall_timeout_s", 0.2)  # both runners read it
    HangingListing.released.clear()
    try:
        namespace = namespace_holding(keys_of("listed", LISTED), 1000)
        opened: list[BackendAdapter] = []
        opener = threading.Thread(
            target=lambda: opened.append(open_dict(backend, capacity=100_000, namespace=namespace)),
            daemon=True,
        )
        opener.start()
        opener.join(BOUND_S)
        assert opened, "opening the adapter waits for good for a listing that hangs"
        adapter = opened[0]
        adapters.append(adapter)
        wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
        stats = adapter.stats()
        assert stats["listing_stalls"] == 1
        assert stats["scan_errors"] == 1
        assert stats["scan_keys"] == (1 if backend is HangingListing else 0)
        store_blank(adapter, keys_of("after", 1), 1000)  # no longer refused as "scanning"
        assert any("listing" in r.getMessage() and "stalled" in r.getMessage() for r in caplog.records)
    finally:
        HangingListing.released.set()


def listing_threads(adapter: BackendAdapter) -> list[threading.Thread]:
    return [
        thread
        for thread in threading.enumerate()
        if thread.name == f"l2-{adapter.state.name}-listing" and thread.is_alive()
    ]


@pytest.mark.parametrize("backend", [HangingListing, HangingListCall], ids=["generator", "list"])
def test_no_new_listing_while_a_previous_one_is_stuck_in_the_backend(
    backend: type[DictBackend],
    adapters: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain list_keys stuck in storage leaves its reading thread behind (nothing can
    cancel it): a new listing of the same adapter meanwhile -- each retried seeding of the
    eviction policy -- is refused (counted, logged) rather than leave one more thread stuck.
    Once the backend answers again the stuck thread ends (a call that stalled before its
    first batch included: nobody will ask it for one), and listings run again."""
    import lmcache_tiers.l2.scan as scan

    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 1)
    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(Runner, "listing_stall_timeout_s", 0.2)
    HangingListing.released.clear()
    try:
        namespace = namespace_holding(keys_of("listed", LISTED), 1000)
        adapter = open_dict(backend, capacity=100_000, namespace=namespace)
        adapters.append(adapter)
        wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
        assert adapter.stats()["listing_stalls"] == 1
        stuck = set(listing_threads(adapter))  # the scan's (and any an earlier test left)
        assert stuck, "the scan's listing is stuck in the backend"
        for _ in range(3):
            with pytest.raises(TimeoutError, match="still stuck"):
                list(adapter.iter_keys())
        assert set(listing_threads(adapter)) <= stuck, "a refused listing left a thread behind"
        assert adapter.stats()["listings_refused_stuck"] == 3
        assert any("still stuck" in r.getMessage() for r in caplog.records)
    finally:
        HangingListing.released.set()
    wait_until(lambda: not any(thread.is_alive() for thread in stuck), "the stuck listing ending")
    # Released, HangingListing lists its first entry and ends: read whole, not refused.
    listed = 1 if backend is HangingListing else LISTED
    assert len(list(adapter.iter_keys())) == listed, "a listing runs again once none is stuck"
