"""A LOOKUP's new keys reach the storage undecoded (``LazyKeys``): a miss at the first key
decodes no other, and whatever needs them all (a hit in L1, the adapters) gets them all."""

from __future__ import annotations

from collections.abc import Callable

from engine_support import keys_of, mock, payload, store, store_in_l2_only

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.lazy_keys import LazyKeys
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.decoding import KeyCache, decode_request

Engine = Callable[..., StorageManager]
SIZE = 16 * 1024
COUNT = 48


def as_decoded(keys: list[ObjectKey]) -> LazyKeys:
    """``keys`` as a server that never saw them decodes them from a LOOKUP."""
    decoded = decode_request(p.encode(p.Lookup(1, "", keys)), KeyCache())
    assert isinstance(decoded, p.Lookup) and isinstance(decoded.keys, LazyKeys)
    return decoded.keys


def test_a_new_prompt_misses_without_its_keys_decoded(engine: Engine) -> None:
    storage = engine([])
    store(storage, keys_of(1, 4), SIZE)
    lazy = as_decoded(keys_of(2, COUNT))
    handle, locked = storage.start_prefetch(lazy)
    assert locked == [] and storage.query_prefetch(handle) == 0
    assert lazy._decoded is None


def test_keys_in_l1_the_decoder_forgot_are_all_found(engine: Engine) -> None:
    storage = engine([])
    keys = keys_of(3, COUNT)
    store(storage, keys[:40], SIZE)
    for _ in range(2):  # the second time as the L1 prefix remembered from the first
        _, locked = storage.start_prefetch(as_decoded(keys))
        assert locked == keys[:40]
        storage.release(keys[:40])


def test_keys_only_in_l2_are_loaded(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(4, COUNT)
    store_in_l2_only(storage, keys[: COUNT - 3], SIZE)
    lazy = as_decoded(keys)
    handle, locked = storage.start_prefetch(lazy)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == COUNT - 3
    objects = storage.read(keys)
    assert [obj.key for obj in objects] == keys[: COUNT - 3]
    assert all(bytes(storage.view(obj)) == payload(obj.key, SIZE) for obj in objects)
    storage.release(keys[: COUNT - 3], 2)  # the read above and the prefetch's own lock


def test_a_repeat_ends_the_prefix_counted_for_l2(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(5, COUNT // 2)
    store_in_l2_only(storage, keys, SIZE)
    handle, locked = storage.start_prefetch(as_decoded(keys + keys))
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == len(keys)
    storage.release(keys)
