"""A prefetch collects the layouts of the keys it loaded while it still pins them: the
side table keeping layouts of loaded keys drops the oldest entries of unpinned keys past
its bound, and an entry dropped before its prefetch collects it leaves the loaded object
with no layout (a front end's layout check then goes by size alone: it fails open)."""

from __future__ import annotations

import threading
import time

from engine_support import GatedConfig, gated_backend, keys_of, payload

import lmcache_tiers.l2.state as state_module
from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.layout import TensorLayout
from lmcache_tiers.storage import StorageManager

SHAPE = (2, 4, 16, 64)
SIZE = 2 * 4 * 16 * 64 * 2  # float16
BOUND = 4


def flood_of_uncollected_loads(storage: StorageManager) -> None:
    """Loads no prefetch collects (a benchmark's, say) end: past the bound, the oldest
    layouts of unpinned keys are dropped."""
    state = storage.adapters[0].state  # type: ignore[attr-defined]
    for number in range(4 * BOUND):
        other = ObjectKey("other", 0, number.to_bytes(8, "big"))
        state.loading_begin([other])
        state.note_layout(other, "other")
        state.loading_end([other], [other])


def in_l2_only_with_layout(storage: StorageManager, keys: list[ObjectKey], layout: str) -> None:
    reserved = storage.reserve_write(keys, [SIZE] * len(keys), [layout] * len(keys))
    for each, obj in reserved.items():
        storage.view(obj)[:] = payload(each, SIZE)
    storage.commit_write(list(reserved))
    assert storage.flush(10)
    storage.clear()


def test_layouts_are_collected_before_the_keys_are_unpinned(engine, monkeypatch) -> None:
    monkeypatch.setattr(state_module, "_LOADED_LAYOUTS_MAX", BOUND)
    storage = engine([AdapterSpec(type="records", config=GatedConfig())])
    half = TensorLayout("float16", SHAPE).format()
    keys = keys_of(1, 2)
    in_l2_only_with_layout(storage, keys, half)

    # Other loads end right after the prefetch lets go of its pins (on another thread in
    # production; here at the exact point, so the order is certain).
    adapter = storage.adapters[0]
    unlock = adapter.unlock

    def unlock_then_other_loads_end(unpinned):  # type: ignore[no-untyped-def]
        unlock(unpinned)
        flood_of_uncollected_loads(storage)

    monkeypatch.setattr(adapter, "unlock", unlock_then_other_loads_end)
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == len(keys)
    loaded = storage.read(keys)
    assert [obj.layout for obj in loaded] == [half] * len(keys)
    storage.release(keys)


def test_a_given_up_prefetchs_load_leaves_no_layout_behind(engine, monkeypatch) -> None:
    # Kept, a layout nobody collects would be the first handed to the next load of the key
    # (one entry per load, the oldest first): that load's object would get this one's.
    storage = engine([AdapterSpec(type="records", config=GatedConfig())], l1_lock_ttl_s=0.5)
    keys = keys_of(2, 2)
    in_l2_only_with_layout(storage, keys, TensorLayout("float16", SHAPE).format())
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
    assert storage.adapters[0].take_layouts(keys) == ["", ""]
