"""A chunk loaded from L2 keeps the tensor layout its writer declared: the record holds it,
and the prefetch gives it back to the L1 object it fills, so a front end that checks
layouts (lmcache_mp refuses another instance's dtype or shape) checks loaded chunks too."""

from __future__ import annotations

from engine_support import GatedConfig, keys_of, payload

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.layout import TensorLayout
from lmcache_tiers.storage import StorageManager

SHAPE = (2, 4, 16, 64)
SIZE = 2 * 4 * 16 * 64 * 2  # float16


def records() -> AdapterSpec:
    return AdapterSpec(type="records", config=GatedConfig())


def store_with_layout(storage: StorageManager, keys, layout: str) -> None:  # type: ignore[no-untyped-def]
    reserved = storage.reserve_write(keys, [SIZE] * len(keys), [layout] * len(keys))
    for key, obj in reserved.items():
        storage.view(obj)[:] = payload(key, SIZE)
    storage.commit_write(list(reserved))


def test_a_chunk_loaded_from_l2_has_the_layout_it_was_stored_with(engine) -> None:
    storage = engine([records()])
    half = TensorLayout("float16", SHAPE).format()
    unknown = keys_of(2, 2)
    keys = keys_of(1, 3)
    store_with_layout(storage, keys, half)
    storage.commit_write(list(storage.reserve_write(unknown, [SIZE] * 2)))  # no layout given
    assert storage.flush(10)
    storage.clear()
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == len(keys)
    assert storage.wait_prefetch(storage.submit_prefetch(unknown), 10) == len(unknown)
    loaded = storage.read(keys)
    assert [obj.layout for obj in loaded] == [half] * len(keys)
    assert [bytes(storage.view(obj)) for obj in loaded] == [payload(key, SIZE) for key in keys]
    assert [obj.layout for obj in storage.read(unknown)] == ["", ""]
    storage.release(keys, 2)
    storage.release(unknown, 2)
