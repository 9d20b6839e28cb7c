"""A prefetch gives each object it fills the layout of the record its own load copied: the
layout travels with that load's result, never through a table shared by the loads of a key.
Shared, a load nobody collects (a benchmark calling ``submit_load``, a given-up prefetch's)
or two loads collected in the other order hand one load's layout to another's object: with
engines of two dtypes sharing keys, a reader would be handed fp16 bytes labelled bf16, and
the front end's layout check (``retrieve_layout_mismatch``) would pass them."""

from __future__ import annotations

import threading
import time

from engine_support import GatedConfig, gated_backend, keys_of, payload

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.layout import TensorLayout
from lmcache_tiers.storage import StorageManager

SHAPE = (2, 4, 16, 64)
SIZE = 2 * 4 * 16 * 64 * 2  # float16 and bfloat16 alike
HALF = TensorLayout("float16", SHAPE).format()
BRAIN = TensorLayout("bfloat16", SHAPE).format()


def records() -> AdapterSpec:
    return AdapterSpec(type="records", config=GatedConfig())


def in_l2_only_with_layout(storage: StorageManager, keys: list[ObjectKey], layout: str) -> None:
    reserved = storage.reserve_write(keys, [SIZE] * len(keys), [layout] * len(keys))
    for each, obj in reserved.items():
        storage.view(obj)[:] = payload(each, SIZE)
    storage.commit_write(list(reserved))
    assert storage.flush(10)
    storage.clear()


def wait_loads_ok(storage: StorageManager, count: int) -> None:
    """Until the adapter counted ``count`` keys loaded (a load no controller owns, whose
    result nobody waits for)."""
    deadline = time.monotonic() + 10
    while storage.adapters[0].stats().get("load_keys_ok", 0) < count:
        assert time.monotonic() < deadline, "the load never completed"
        time.sleep(0.01)


def test_a_prefetch_gets_its_own_loads_layout_not_an_uncollected_earlier_ones(engine) -> None:
    storage = engine([records()])
    keys = keys_of(1, 2)
    in_l2_only_with_layout(storage, keys, BRAIN)
    # A load no prefetch is behind (a benchmark's) reads the bf16 records ...
    adapter = storage.adapters[0]
    adapter.submit_load(keys, [memoryview(bytearray(SIZE)) for _ in keys])
    wait_loads_ok(storage, len(keys))
    # ... then an engine of another dtype rewrites the keys, and a prefetch loads those.
    in_l2_only_with_layout(storage, keys, HALF)
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == len(keys)
    loaded = storage.read(keys)
    assert [obj.layout for obj in loaded] == [HALF] * len(keys), "the bytes are fp16"
    storage.release(keys)


def test_a_given_up_prefetchs_load_leaves_nothing_for_the_next_prefetch(engine, monkeypatch) -> None:
    storage = engine([records()], l1_lock_ttl_s=0.5)
    keys = keys_of(2, 2)
    in_l2_only_with_layout(storage, keys, BRAIN)
    # The records backend does not park loads itself: its load waits at a gate here.
    backend = gated_backend(storage)
    load_records = backend.get_many_into
    gate, started = threading.Event(), threading.Semaphore(0)

    def parked_load(*args):  # type: ignore[no-untyped-def]
        started.release()
        gate.wait()
        return load_records(*args)

    monkeypatch.setattr(backend, "get_many_into", parked_load)
    parked = storage.submit_prefetch(keys)
    assert started.acquire(timeout=10)
    assert storage.wait_prefetch(parked, 10) == 0, "given up at its result deadline"
    gate.set()  # the load goes through after all, its request gone
    deadline = time.monotonic() + 10
    while storage.l1.stats().write_locked or storage.adapters[0].pinned_keys():
        assert time.monotonic() < deadline, "the given-up load never settled"
        time.sleep(0.01)
    assert storage.status()["failures"]["prefetch_timed_out"] == 1
    in_l2_only_with_layout(storage, keys, HALF)
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == len(keys)
    assert [obj.layout for obj in storage.read(keys)] == [HALF] * len(keys)
    storage.release(keys, 2)
