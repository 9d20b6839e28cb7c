"""What core does for every backend beyond the suite: capacity refusals, the start-up scan,
serde staging and bounds, and how factories' results are wrapped."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from l2_backends import _SPACES, AsyncDictBackend, DictBackend, DictConfig, Xor, Zlib, open_dict, wait_until

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import (
    AdapterContext,
    BackendAdapter,
    BackendContext,
    Capacity,
    L2Adapter,
    create_adapter,
)
from lmcache_tiers.l2.accounting import ByteAccounting, ObjectSize, Verdict
from lmcache_tiers.l2.context import buffer_address
from lmcache_tiers.serde import SerdeContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

KIB = 1 << 10


def store(adapter: L2Adapter, keys: Sequence[ObjectKey], sizes: Sequence[int]) -> list[bool]:
    return BlockingAdapterClient(adapter, timeout=30).store(
        keys, [memoryview(pattern(i, size)) for i, size in enumerate(sizes)]
    )


# -- capacity ----------------------------------------------------------------------------------


def test_a_batch_is_checked_against_capacity_one_store_after_the_other(adapters: list[L2Adapter]) -> None:
    adapter = open_dict(capacity=1024 * KIB)
    adapters.append(adapter)
    half, quarter = 512 * KIB, 256 * KIB
    keys = make_keys(4)
    assert store(adapter, keys[:2], [half, half]) == [True, True]
    # Full: an overwrite that shrinks keys[0] frees nothing before it has succeeded.
    assert store(adapter, [keys[0], keys[2]], [quarter, quarter]) == [True, False]
    assert adapter.used_bytes() == half + quarter
    assert store(adapter, keys[2:3], [quarter]) == [True]
    assert adapter.used_bytes() == 1024 * KIB
    assert adapter.delete(keys[2:3]) == [True]
    # The second store of a key in one batch replaces the first one's bytes.
    assert store(adapter, [keys[3], keys[3]], [quarter // 2, quarter // 4]) == [True, True]
    assert adapter.used_bytes() == half + quarter + quarter // 4
    stats = adapter.stats()
    assert stats["capacity_refusals"] == 1
    assert stats["objects"] == 3


def test_admission_reserves_what_stores_in_flight_may_add() -> None:
    accounting = ByteAccounting()
    limit = Capacity(bytes=100)
    a, b, c = make_keys(3)
    first = accounting.admit([(a, 60)], limit)
    assert first.verdicts == [Verdict.ADMITTED]
    assert accounting.admit([(b, 50)], limit).verdicts == [Verdict.FULL], "60 are reserved"
    accounting.settle(first, [])  # the store failed: nothing accounted, reservation gone
    second = accounting.admit([(b, 50), (c, 50)], limit)
    assert second.verdicts == [Verdict.ADMITTED, Verdict.ADMITTED]
    accounting.settle(second, [(b, ObjectSize(50, 50)), (c, ObjectSize(50, 50))])
    accounting.settle(second, [])  # settling twice releases nothing twice
    assert accounting.used_bytes == 100
    assert accounting.admit([(c, 50)], limit).verdicts == [Verdict.ADMITTED], "an equal overwrite fits"


def test_concurrent_stores_never_overshoot_and_keep_the_accounting_exact(adapters: list[L2Adapter]) -> None:
    class Parallel(DictBackend):
        concurrency = 4

    adapter = open_dict(Parallel, capacity=64 * KIB)
    adapters.append(adapter)
    keys = make_keys(40)
    sizes = [3 * KIB + i for i in range(40)]
    results: list[list[bool]] = []
    client = BlockingAdapterClient(adapter, timeout=30)  # one consumer of the store results

    def one(start: int) -> None:
        batch = [memoryview(pattern(i, size)) for i, size in enumerate(sizes[start : start + 10])]
        results.append(client.store(keys[start : start + 10], batch))

    threads = [threading.Thread(target=one, args=(start,)) for start in range(0, 40, 10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    backend: Parallel = adapter.backend  # type: ignore[assignment]
    stored = [key for key in keys if key in backend.objects]
    assert adapter.used_bytes() == sum(sizes[keys.index(key)] for key in stored) <= 64 * KIB
    assert sum(map(sum, results)) == len(stored) > 0
    assert adapter.stats()["capacity_refusals"] == 40 - len(stored)


class Slots(DictBackend):
    """A slot store: at most 3 objects, whatever their size."""

    def capacity(self) -> Capacity:
        return Capacity(objects=3)


def test_an_object_capacity_counts_slots(adapters: list[L2Adapter]) -> None:
    adapter = open_dict(Slots)
    adapters.append(adapter)
    keys = make_keys(4)
    assert store(adapter, keys, [100, 200000, 1, 5]) == [True, True, True, False]
    assert adapter.usage() == 1.0
    assert store(adapter, keys[:1], [300]) == [True], "an overwrite takes no new slot"
    assert adapter.delete(keys[:1]) == [True]
    assert adapter.usage() == pytest.approx(2 / 3)
    assert store(adapter, keys[3:], [5]) == [True]


class BrokenCapacity(DictBackend):
    def capacity(self) -> int:
        raise OSError("statvfs failed")


def test_a_capacity_that_cannot_be_read_refuses_stores(adapters: list[L2Adapter]) -> None:
    adapter = open_dict(BrokenCapacity)
    adapters.append(adapter)
    assert store(adapter, make_keys(2), [10, 10]) == [False, False]
    assert adapter.usage() == -1.0
    assert adapter.stats()["backend_errors"] >= 1


# -- the start-up scan ---------------------------------------------------------------------------


def fill_namespace(count: int, size: int, salt: str = "") -> str:
    namespace = uuid.uuid4().hex
    _SPACES[namespace] = {key: pattern(i, size) for i, key in enumerate(make_keys(count, salt=salt))}
    return namespace


def test_usage_is_right_right_after_start(adapters: list[L2Adapter]) -> None:
    namespace = fill_namespace(10, 1000, salt="t")
    adapter = open_dict(namespace=namespace, capacity=20_000)
    adapters.append(adapter)
    assert adapter.used_bytes() == 10_000
    assert adapter.used_bytes_by_salt() == {"t": 10_000}
    assert adapter.usage() == 0.5
    stats = adapter.stats()
    assert (stats["scan_running"], stats["scan_keys"], stats["scan_bytes"]) == (0, 10, 10_000)


class GatedListing(DictBackend):
    """Lists one entry per gate release, so a test can act while the scan runs."""

    gate = threading.Semaphore(0)

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        for item in super().list_keys():
            assert GatedListing.gate.acquire(timeout=30)
            yield item


def open_scanning(
    adapters: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    entries: int,
    backend: type[GatedListing] = GatedListing,
    **options: Any,
) -> tuple[L2Adapter, str]:
    """An adapter (and its namespace) over ``entries`` listed objects of 1000 bytes whose
    start-up scan accounted the first in the foreground, then accounts one more per
    release of ``GatedListing.gate``."""
    import lmcache_tiers.l2.scan as scan

    monkeypatch.setattr(scan, "BATCH_ENTRIES", 1)
    monkeypatch.setattr(scan, "FOREGROUND_ENTRIES", 1)
    GatedListing.gate = threading.Semaphore(1)  # the first entry in the foreground
    namespace = fill_namespace(entries, 1000)
    adapter = open_dict(backend, namespace=namespace, **options)
    adapters.append(adapter)
    return adapter, namespace


def wait_for_the_scan(adapter: L2Adapter) -> None:
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")


def test_while_the_scan_runs_stores_that_add_bytes_are_refused(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, _namespace = open_scanning(adapters, monkeypatch, 3, capacity=10_000)
    listed = make_keys(3)
    assert adapter.stats()["scan_running"] == 1
    assert adapter.used_bytes() == 1000
    assert store(adapter, make_keys(1, start=50), [10]) == [False], "the usage is not known yet"
    assert adapter.stats()["store_refused_scanning"] == 1
    # Deleted while the scan runs: the listing must not bring it back.
    assert adapter.delete(listed[2:]) == [True]
    GatedListing.gate.release(2)  # two more entries listed
    wait_for_the_scan(adapter)
    assert adapter.used_bytes() == 2000, "listed keys, minus the one deleted meanwhile"
    assert store(adapter, make_keys(1, start=50), [10]) == [True]


def test_a_key_a_lookup_found_absent_while_the_scan_runs_is_not_accounted_from_the_listing(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing may be older than a lookup's answer (a directory read ahead, a page of
    an object listing): a key removed behind the adapter's back -- by another server
    sharing the store -- and answered absent must not come back from it, accounted for
    bytes the store no longer holds."""
    adapter, namespace = open_scanning(adapters, monkeypatch, 3)
    listed = make_keys(3)
    assert adapter.stats()["scan_running"] == 1
    del _SPACES[namespace][listed[2]]  # another server deleted it; the listing holds it still
    client = BlockingAdapterClient(adapter, timeout=30)
    assert client.lookup_and_lock(listed[2:]).found == [False]
    GatedListing.gate.release(2)  # two more entries listed
    wait_for_the_scan(adapter)
    assert adapter.used_bytes() == 2000, "the listed keys still stored"
    assert adapter.stats()["objects"] == 2


class ListedWhileAsked(GatedListing):
    """Gated listing whose lookups run ``answered`` between reading their answer and
    returning it: the scan can account what the answer says is absent in between."""

    answered: Any = None

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        answer = super().contains_many(keys)
        if ListedWhileAsked.answered is not None:
            ListedWhileAsked.answered()
        return answer


def test_a_key_the_scan_accounts_while_a_lookup_finds_it_absent_is_not_accounted(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup asked about a key not accounted yet; while the backend answered "absent"
    the scan accounted it from its older listing: once the answer is in, the key is not
    accounted (its bytes are not held against the capacity) and counts as vanished."""
    adapter, namespace = open_scanning(adapters, monkeypatch, 4, ListedWhileAsked)
    listed = make_keys(4)
    del _SPACES[namespace][listed[2]]  # another server deleted it; the listing holds it still

    def scan_past_it() -> None:
        GatedListing.gate.release(2)  # two more entries listed
        # listed[2] accounted; listed[3] not yet
        wait_until(lambda: adapter.used_bytes() == 3000, "the scan accounting listed[2]")

    monkeypatch.setattr(ListedWhileAsked, "answered", staticmethod(scan_past_it))
    client = BlockingAdapterClient(adapter, timeout=30)
    assert client.lookup_and_lock(listed[2:3]).found == [False]
    assert adapter.stats()["scan_running"] == 1
    assert adapter.used_bytes() == 2000, "released once the lookup answered"
    GatedListing.gate.release()
    wait_for_the_scan(adapter)
    assert adapter.used_bytes() == 3000, "the listed keys still stored"
    stats = adapter.stats()
    assert stats["objects"] == 3
    assert stats["objects_vanished"] == 1


def test_a_key_the_scan_accounts_as_it_ends_while_a_lookup_finds_it_absent_is_not_accounted(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the scan accounts the key and ends while the backend answers: the
    lookup began during the scan, so its answer still releases what the scan accounted
    (without it the key stays accounted until an eviction or a later lookup notices)."""
    adapter, namespace = open_scanning(adapters, monkeypatch, 3, ListedWhileAsked)
    listed = make_keys(3)
    del _SPACES[namespace][listed[2]]  # another server deleted it; the listing holds it still

    def scan_to_its_end() -> None:
        GatedListing.gate.release(2)  # two more entries listed
        wait_for_the_scan(adapter)  # listed[2] accounted, the listing at its end

    monkeypatch.setattr(ListedWhileAsked, "answered", staticmethod(scan_to_its_end))
    client = BlockingAdapterClient(adapter, timeout=30)
    assert client.lookup_and_lock(listed[2:3]).found == [False]
    assert adapter.used_bytes() == 2000, "released once the lookup answered"
    stats = adapter.stats()
    assert stats["objects"] == 2
    assert stats["objects_vanished"] == 1
    # Once that lookup settled, a store after the scan and a later miss are as ever.
    monkeypatch.setattr(ListedWhileAsked, "answered", None)
    assert store(adapter, make_keys(1, start=50), [10]) == [True]
    assert client.lookup_and_lock(make_keys(1, start=60)).found == [False]
    assert adapter.stats()["objects"] == 3


class FailingListing(DictBackend):
    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        yield make_keys(1)[0], 10
        raise OSError("listing broke")


def test_a_failing_listing_ends_the_scan_and_counts_it(adapters: list[L2Adapter]) -> None:
    adapter = open_dict(FailingListing, capacity=1000)
    adapters.append(adapter)
    stats = adapter.stats()
    assert (stats["scan_running"], stats["scan_errors"]) == (0, 1)
    assert store(adapter, make_keys(1, start=9), [10]) == [True], "stores go on after the scan"


class FailingRemoteListing(DictBackend):
    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        yield make_keys(1)[0], 10
        raise OSError("GET http://reader:s3cret@host/kv/ failed")


def test_a_failing_listing_is_told_without_a_url_password(
    adapters: list[L2Adapter], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        adapters.append(open_dict(FailingRemoteListing, capacity=1000))
    assert "listing failed" in caplog.text
    assert "s3cret" not in caplog.text


class OddListing(DictBackend):
    def list_keys(self) -> list[Any]:
        return [(make_keys(1)[0], 10), "not an entry", (make_keys(1, start=1)[0], -1)]


def test_listed_entries_that_are_not_key_size_pairs_are_counted_and_ignored(
    adapters: list[L2Adapter],
) -> None:
    adapter = open_dict(OddListing)
    adapters.append(adapter)
    assert adapter.used_bytes() == 10
    assert adapter.stats()["scan_invalid_entries"] == 2


class BrokenEntryListing(DictBackend):
    def list_keys(self) -> list[Any]:
        first, second = make_keys(2)
        return [(first, 10), None, "not an entry", (second, 10)]


def test_listing_keys_skips_entries_that_are_not_key_size_pairs(adapters: list[L2Adapter]) -> None:
    # What L2 eviction is seeded with at start: one odd entry must neither end the
    # listing (losing every stored key, which would then never be evicted) nor put
    # something that is not a key among the victims.
    adapter = open_dict(BrokenEntryListing)
    adapters.append(adapter)
    assert list(adapter.iter_keys()) == make_keys(2)
    assert adapter.stats()["scan_invalid_entries"] == 2


# -- serde staging and bounds --------------------------------------------------------------------


class Bounded(Xor):
    """Declares a bound its output respects, except when told to lie."""

    name = "bounded"
    lie = False

    def max_encoded_size(self, size: int) -> int:
        return size

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        encoded = super().encode(data, context)
        return encoded + b"!" if self.lie and data.nbytes == 100 else encoded


class Seen(DictBackend):
    """Remembers the address of every payload it was handed."""

    addresses: list[int] = []

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        Seen.addresses += [buffer_address(p) for p in payloads]
        return super().put_many(keys, payloads)


def test_an_output_over_the_declared_bound_fails_that_object_only(adapters: list[L2Adapter]) -> None:
    serde = Bounded()
    serde.lie = True
    adapter = open_dict(serde=[serde])
    adapters.append(adapter)
    keys = make_keys(2)
    assert store(adapter, keys, [100, 200]) == [False, True]
    assert adapter.stats()["serde_bound_exceeded"] == 1
    result = BlockingAdapterClient(adapter).lookup_and_lock(keys)
    assert result.found == [False, True]
    adapter.unlock(keys[1:])


class Refusing(Xor):
    name = "refusing"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        if data.nbytes == 100:
            raise ValueError("this object cannot be encoded")
        return super().encode(data, context)


def test_a_serde_raising_fails_that_object_not_the_batch(adapters: list[L2Adapter]) -> None:
    adapter = open_dict(serde=[Refusing()])
    adapters.append(adapter)
    assert store(adapter, make_keys(3), [50, 100, 150]) == [True, False, True]
    assert adapter.stats()["serde_encode_failures"] == 1
    assert adapter.stats().get("backend_errors", 0) == 0


@pytest.mark.parametrize("serde", [Bounded(), Zlib()], ids=["bounded", "unbounded"])
def test_encoded_payloads_are_staged_page_aligned(adapters: list[L2Adapter], serde: Any) -> None:
    Seen.addresses = []
    adapter = open_dict(Seen, serde=[serde])
    adapters.append(adapter)
    data = pattern(3, 70_000)
    client = BlockingAdapterClient(adapter)
    keys = make_keys(3)
    assert client.store(keys, [memoryview(data)] * 3) == [True] * 3
    assert len(Seen.addresses) == 3 and all(address % 4096 == 0 for address in Seen.addresses)
    buffers = [memoryview(bytearray(len(data))) for _ in keys]
    assert client.lookup_and_lock(keys).found == [True] * 3
    assert client.load(keys, buffers) == [True] * 3
    assert all(bytes(buffer) == data for buffer in buffers)
    adapter.unlock(keys)


def test_staging_buffers_are_sized_from_the_chain_bound() -> None:
    from lmcache_tiers.l2.codec import SerdeChain, StagingPool

    class Doubling(Xor):
        name = "doubling"

        def max_encoded_size(self, size: int) -> int:
            return 2 * size + 4096

    chain = SerdeChain([Bounded(), Doubling()])
    assert chain.bound(10_000) == 2 * 10_000 + 4096
    staged = chain.encode(make_keys(1)[0], memoryview(pattern(1, 10_000)))
    assert staged.capacity == StagingPool.size_class(2 * 10_000 + 4096)
    assert staged.view.nbytes == 10_000
    staged.release()
    assert SerdeChain([Zlib()]).bound(10) is None


# -- what factories may return --------------------------------------------------------------------


def build(factory: Any) -> L2Adapter:
    config = DictConfig()
    return create_adapter(factory, config, AdapterContext(index=0, name="0:t", config=config))


def test_a_factory_returning_neither_backend_nor_adapter_is_a_config_error() -> None:
    closed: list[bool] = []

    class Half:
        def put_many(self, keys: Any, payloads: Any) -> list[bool]:
            return []

        def close(self) -> None:
            closed.append(True)

    with pytest.raises(ConfigError, match="lacks contains_many, get_many_into, delete_many, list_keys"):
        build(lambda config, context: Half())
    assert closed == [True], "what was built is closed again"


def test_mixing_coroutines_and_plain_batch_methods_is_refused() -> None:
    class Mixed(DictBackend):
        async def get_many_into(self, keys: Any, buffers: Any) -> list[bool]:  # type: ignore[override]
            return []

    with pytest.raises(TypeError, match="mixes coroutine and plain batch methods"):
        build(Mixed)


def test_a_factory_may_return_a_complete_adapter(adapters: list[L2Adapter]) -> None:
    inner = open_dict()
    adapters.append(inner)
    assert build(lambda config, context: inner) is inner


class WithGauges(DictBackend):
    def stats(self) -> dict[str, int]:
        return {"slots_used": 7}


def test_backend_gauges_are_merged_into_the_adapter_stats(adapters: list[L2Adapter]) -> None:
    adapter = build(WithGauges)
    adapters.append(adapter)
    assert isinstance(adapter, BackendAdapter)
    stats = adapter.stats()
    assert stats["slots_used"] == 7 and stats["pending_tasks"] == 0


class Counting(Xor):
    name = "counting"

    def stats(self) -> dict[str, int]:
        return {"passed_through": 3}


def test_serde_counters_show_in_the_adapter_stats(adapters: list[L2Adapter]) -> None:
    adapter = open_dict(serde=[Counting()])
    adapters.append(adapter)
    assert adapter.stats()["serde_counting_passed_through"] == 3


def test_counters_of_two_serdes_of_one_name_in_a_chain_add_up(adapters: list[L2Adapter]) -> None:
    # Two aesgcm stages (key_env and key_file) are a valid chain: the inner stage's
    # refusals must not be hidden behind the outer stage's counts.
    adapter = open_dict(serde=[Counting(), Counting()])
    adapters.append(adapter)
    assert adapter.stats()["serde_counting_passed_through"] == 6


def test_the_context_offers_what_a_backend_needs() -> None:
    seen: dict[str, Any] = {}

    def factory(config: DictConfig, context: BackendContext) -> DictBackend:
        seen["name"], seen["config"], seen["l1"] = context.name, context.config, context.l1_buffer
        context.count("opened_by_factory")
        seen["sleep"] = context.sleep(0)
        return DictBackend(config, context)

    arena = memoryview(bytearray(4096))
    config = DictConfig()
    adapter = create_adapter(factory, config, AdapterContext(0, "0:t", config, l1_buffer=arena))
    try:
        assert seen == {"name": "0:t", "config": config, "l1": arena, "sleep": True}
        assert adapter.stats()["opened_by_factory"] == 1
    finally:
        adapter.close()
    device = AdapterContext(0, "0:t", config, l1_buffer=arena, l1_is_memory=False)
    adapter = create_adapter(factory, config, device)
    adapter.close()
    assert seen["l1"] is None, "memory that is not host DRAM is not offered for registration"


class TracedListing(GatedListing):
    """A listing that tells when its generator was closed (what holds a directory open)."""

    ended = threading.Event()

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        try:
            yield from super().list_keys()
        finally:
            TracedListing.ended.set()


def test_a_scan_stopped_by_close_ends_the_backends_listing(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    TracedListing.ended = threading.Event()
    adapter, _namespace = open_scanning(adapters, monkeypatch, 5, backend=TracedListing)
    assert adapter.stats()["scan_running"] == 1
    closing = threading.Thread(target=adapter.close)
    closing.start()  # it waits for the scan, which waits for the listing's next entry
    wait_until(adapter.state.closing.is_set, "the adapter's close")
    GatedListing.gate.release()  # the listing's next entry comes after the close began
    wait_until(TracedListing.ended.is_set, "the end of the backend's listing")
    closing.join(30)
    assert not closing.is_alive()


class HeldThread(threading.Thread):
    """The scan's background thread, started only when the test says so."""

    held: list[threading.Thread] = []

    def start(self) -> None:
        HeldThread.held.append(self)


def test_a_scan_whose_thread_sees_the_close_first_ends_the_backends_listing(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The foreground read part of the listing; the close comes before the scan's thread
    # looks at it once: the listing it leaves must be ended all the same.
    import types

    import lmcache_tiers.l2.scan as scan

    HeldThread.held = []
    monkeypatch.setattr(scan, "threading", types.SimpleNamespace(Thread=HeldThread, Lock=threading.Lock))
    TracedListing.ended = threading.Event()
    adapter, _namespace = open_scanning(adapters, monkeypatch, 5, backend=TracedListing)
    [background] = HeldThread.held
    adapter.state.closing.set()
    threading.Thread.start(background)
    background.join(30)
    assert not background.is_alive()
    assert adapter.stats()["scan_running"] == 0
    assert TracedListing.ended.is_set(), "the listing the foreground began was left open"


class TracedAsyncListing(AsyncDictBackend):
    """A coroutine backend's listing, one entry per release of ``GatedListing.gate``, that
    tells when its async generator was closed."""

    ended = threading.Event()
    ended_before_close: list[bool] = []

    async def close(self) -> None:
        TracedAsyncListing.ended_before_close.append(TracedAsyncListing.ended.is_set())
        await super().close()

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        try:
            for item in DictBackend.list_keys(self):
                # Waited for off the loop: the loop must stay free to close the adapter.
                assert await asyncio.to_thread(GatedListing.gate.acquire, True, 30)
                yield item
        finally:
            TracedAsyncListing.ended.set()


def test_a_scan_stopped_by_close_ends_a_coroutine_backends_listing(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    TracedAsyncListing.ended = threading.Event()
    TracedAsyncListing.ended_before_close = []
    adapter, _namespace = open_scanning(adapters, monkeypatch, 5, backend=TracedAsyncListing)  # type: ignore[arg-type]
    assert adapter.stats()["scan_running"] == 1
    closing = threading.Thread(target=adapter.close)
    closing.start()  # it waits for the scan, which waits for the listing's next entry
    wait_until(adapter.state.closing.is_set, "the adapter's close")
    GatedListing.gate.release()  # the listing's next entry comes after the close began
    closing.join(30)
    assert not closing.is_alive()
    # Ended before the backend's close (which may release what the listing reads from),
    # not left for the loop's shutdown to finalize.
    assert TracedAsyncListing.ended_before_close == [True]


class StatsFail(Xor):
    name = "statsfail"

    def stats(self) -> dict[str, int]:
        raise RuntimeError("the serde's counters are unreadable")


def test_a_serde_whose_stats_raise_is_counted_and_the_others_still_show(
    adapters: list[L2Adapter], caplog: pytest.LogCaptureFixture
) -> None:
    """A serde's ``stats()`` raising is counted (``serde_stats_failed``) in the very answer
    it spoils and logged; the other serdes' counters are still reported."""
    adapter = open_dict(serde=[StatsFail(), Counting()])
    adapters.append(adapter)
    stats = adapter.stats()
    assert stats["serde_stats_failed"] == 1
    assert stats["serde_counting_passed_through"] == 3
    assert adapter.stats()["serde_stats_failed"] == 2
    told = [record.getMessage() for record in caplog.records if "statsfail" in record.getMessage()]
    assert len(told) == 1, told  # every scrape fails alike: one line a burst, not one each


def test_keys_touched_while_the_scan_runs_are_bounded_and_the_listing_read_again(
    adapters: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the start-up scan runs, the keys live operations touched are remembered (the
    listing may be older than what they did), but not without bound: a scan that trickles
    for hours under a churn of keys forgets those no longer accounted and reads a listing
    begun after that, which cannot bring back what they removed."""
    import lmcache_tiers.l2.accounting as accounting

    slack, listed_count, churn = 8, 4, 200  # churn: keys stored then deleted while the scan runs
    monkeypatch.setattr(accounting, "TOUCHED_SLACK", slack, raising=False)  # False: fails on the bound
    adapter, _namespace = open_scanning(adapters, monkeypatch, listed_count)
    try:
        assert adapter.stats()["scan_running"] == 1
        client = BlockingAdapterClient(adapter, timeout=30)
        listed = make_keys(listed_count)
        # Deleted while the scan runs, before the churn makes the accounting forget it.
        assert adapter.delete(listed[-1:]) == [True]
        for start in range(100, 100 + churn):
            churned = make_keys(1, start=start)
            assert client.store(churned, [memoryview(pattern(start, 1000))]) == [True]
            assert adapter.delete(churned) == [True]
        touched = len(adapter.state.accounting._touched)
        assert touched <= 2 * len(adapter.state.accounting) + slack + 1, f"{touched} keys remembered"
    finally:
        GatedListing.gate.release(1000)
    wait_for_the_scan(adapter)
    assert adapter.stats().get("scan_relisted", 0) >= 1, "the listing was read again"
    assert adapter.used_bytes() == (listed_count - 1) * 1000, "the key deleted during the scan stays gone"
    assert adapter.stats()["objects"] == listed_count - 1
