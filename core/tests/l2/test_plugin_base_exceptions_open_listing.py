"""A backend that raises what is no ``Exception`` (SystemExit, KeyboardInterrupt, a
BaseException of its own) from ``open`` or ``list_keys``, off the main thread: the plugin's
counted failure, never the end of the adapter's event loop, of its scan or of the process."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

import pytest
from l2_backends import (
    WAIT_BOUND_S,
    AsyncDictBackend,
    DictBackend,
    keys_of,
    namespace_holding,
    off_the_main_thread,
    open_dict,
    store_blank,
    wait_until,
)

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.l2.adapter import BackendCloseFailed
from lmcache_tiers.l2.runners import Runner
from lmcache_tiers.testing.blocking import BlockingAdapterClient

T = TypeVar("T")


class PluginAbort(BaseException):
    """A plugin's own exception that derives from BaseException."""


ERRORS = [SystemExit(3), KeyboardInterrupt(), PluginAbort("plugin bug")]


class FailingOpen(AsyncDictBackend):
    error: BaseException = SystemExit(3)

    async def open(self) -> None:
        raise FailingOpen.error


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_a_coroutine_open_raising_a_base_exception_is_a_counted_open_failure(
    adapters: list[L2Adapter], error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    FailingOpen.error = error
    adapter = off_the_main_thread(lambda: open_dict(FailingOpen))
    adapter.close_timeout_s = 0.5
    adapters.append(adapter)
    assert adapter.stats()["open_failures"] == 1
    assert any("failed to open" in r.getMessage() for r in caplog.records)
    client = BlockingAdapterClient(adapter, timeout=WAIT_BOUND_S)
    # Every operation fails at once: the loop still runs, nothing waits for a dead one.
    assert client.store(keys_of("k", 1), [memoryview(bytes(10))]) == [False]
    assert client.lookup_and_lock(keys_of("k", 1)).found == [False]


def test_a_coroutine_open_raising_its_own_timeout_error_is_a_counted_open_failure(
    adapters: list[L2Adapter], caplog: pytest.LogCaptureFixture
) -> None:
    """A TimeoutError the backend's open raises (its peer did not answer the connect) is
    its failure to open, not an open still running: counted, logged as such, and the
    start-up scan ends rather than wait for good for an open that is over -- refusing
    every store that adds bytes as "scanning" meanwhile."""
    FailingOpen.error = TimeoutError("the peer did not answer the connect")
    adapter = open_dict(FailingOpen, capacity=100_000)
    adapter.close_timeout_s = 0.5
    adapters.append(adapter)
    assert adapter.stats()["open_failures"] == 1
    assert any("failed to open" in r.getMessage() for r in caplog.records)
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")


class TimingOutClose(AsyncDictBackend):
    async def close(self) -> None:
        raise TimeoutError("the peer did not acknowledge the last flush")


def test_a_coroutine_close_raising_its_own_timeout_error_is_a_failed_close_not_a_hung_one() -> None:
    """A close that returned with a TimeoutError of its own failed (counted as
    ``backend_close_failures``, its error shown): it is not a close left running past its
    deadline, which ``backend_close_timeouts`` and its warning would say."""
    adapter = open_dict(TimingOutClose)
    with pytest.raises(BackendCloseFailed, match="did not acknowledge the last flush"):
        adapter.close()
    stats = adapter.stats()
    assert stats["backend_close_failures"] == 1
    assert stats.get("backend_close_timeouts", 0) == 0


class ExitingListing(DictBackend):
    """A plain backend whose listing gives its first entry, then raises ``error``."""

    error: BaseException = SystemExit(3)

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        yield DictBackend.list_keys(self)[0]
        raise ExitingListing.error


class ExitingAsyncListing(AsyncDictBackend):
    """A coroutine backend whose listing gives its first entry, then raises ``error``."""

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        yield DictBackend.list_keys(self)[0]
        raise ExitingListing.error


class ExitingListCall(DictBackend):
    """A plain backend whose ``list_keys`` call itself raises ``error``."""

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        raise ExitingListing.error


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("foreground", [True, False], ids=["foreground", "background"])
@pytest.mark.parametrize("backend", [ExitingListing, ExitingAsyncListing, ExitingListCall])
def test_a_listing_raising_a_base_exception_is_a_counted_scan_error(
    adapters: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    backend: type[DictBackend],
    foreground: bool,
    error: BaseException,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scan ends as failed (``scan_errors``, a log line) at once -- not after the stall
    limit, counted as a stall that never was -- and the adapter serves."""
    import lmcache_tiers.l2.scan as scan

    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 4096 if foreground else 1)
    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(Runner, "listing_stall_timeout_s", WAIT_BOUND_S * 10)
    ExitingListing.error = error
    namespace = namespace_holding(keys_of("listed", 3), 1000)
    adapter = off_the_main_thread(lambda: open_dict(backend, capacity=100_000, namespace=namespace))
    adapters.append(adapter)
    # The scan logs its end just after it stops running: waited for, not raced.
    wait_until(
        lambda: any("start-up scan stopped" in r.getMessage() for r in caplog.records),
        "the end of the start-up scan, logged",
    )
    stats = adapter.stats()
    assert stats["scan_errors"] == 1
    assert stats.get("listing_stalls", 0) == 0
    store_blank(adapter, keys_of("after", 1), 1000)  # the adapter serves, stores admitted
    # Listing again fails the same way, to the reader, as a plain Exception.
    with pytest.raises(Exception, match=type(error).__name__):
        off_the_main_thread(lambda: list(adapter.iter_keys()))


class GatedListing(DictBackend):
    """Lists its first entry, then the rest once ``gate`` is set."""

    gate = threading.Event()

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        entries = DictBackend.list_keys(self)
        yield entries[0]
        GatedListing.gate.wait(WAIT_BOUND_S)
        yield from entries[1:]


class ExitingListener:
    """A listener (an eviction policy's controller calls plugin code) raising ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def on_l2_keys_scanned(self, adapter: object, keys: object) -> None:
        raise self.error

    def on_l2_keys_stored(self, adapter: object, keys: object) -> None:
        raise self.error

    def on_l2_keys_deleted(self, adapter: object, keys: object) -> None:
        raise self.error


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_a_listener_raising_a_base_exception_during_the_scan_leaves_the_scan_going(
    adapters: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Told of scanned keys on the scan's thread, a listener raising a BaseException is
    logged as a failed listener, as one raising an Exception is: the scan goes on to its end
    rather than stop with ``scan_running`` left at 1 and every store refused as scanning."""
    import lmcache_tiers.l2.scan as scan

    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 1)
    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    GatedListing.gate.clear()
    try:
        namespace = namespace_holding(keys_of("listed", 3), 1000)
        adapter = open_dict(GatedListing, capacity=100_000, namespace=namespace)
        adapters.append(adapter)
        adapter.add_listener(ExitingListener(error))  # type: ignore[arg-type]
    finally:
        GatedListing.gate.set()
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    assert adapter.stats()["scan_keys"] == 3, "the scan went on past the failing listener"
    assert any("listener" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
    store_blank(adapter, keys_of("after", 1), 1000)
