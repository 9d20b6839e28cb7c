"""A lookup of 8 keys or more past L1's prefix asks the adapters about the first of them
alone first: where none holds it (a new prompt) the prefix ends there and no other key is
asked about; where one does, or one cannot answer at once, the whole lookup goes on as
before, and every pin the first question took is given back."""

from __future__ import annotations

from collections.abc import Callable

from engine_support import keys_of, mock, payload, store, store_in_l2_only

from lmcache_tiers.controllers.prefetch import PROBE_MIN_KEYS
from lmcache_tiers.storage import StorageManager

Engine = Callable[..., StorageManager]
SIZE = 16 * 1024


def asked(storage: StorageManager, index: int = 0) -> int:
    """Keys adapter ``index`` answered lookups about."""
    stats = storage.adapters[index].stats()
    return int(stats.get("lookup_hits", 0) + stats.get("lookup_misses", 0))


def assert_nothing_held(storage: StorageManager) -> None:
    assert all(adapter.pinned_keys() == {} for adapter in storage.adapters)
    stats = storage.l1.stats()
    assert (stats.write_locked, stats.read_locks) == (0, 0)


def test_a_new_prompt_asks_the_adapters_about_its_first_key_alone(engine: Engine) -> None:
    storage = engine([mock(), mock(namespace="second")])
    handle, locked = storage.start_prefetch(keys_of(1, 40))
    assert locked == [] and storage.query_prefetch(handle) == 0
    assert asked(storage, 0) == asked(storage, 1) == 1
    prompt = keys_of(2, 40)
    store(storage, prompt[:5], SIZE)
    assert storage.flush(10)
    before = asked(storage)
    _, locked = storage.start_prefetch(prompt)
    assert locked == prompt[:5], "the L1 prefix; the first key past it asked about alone"
    assert asked(storage) - before == 1
    storage.release(locked)
    assert_nothing_held(storage)


def test_a_prompt_whose_first_key_past_l1_is_in_l2_is_looked_up_whole(engine: Engine) -> None:
    storage = engine([mock()])
    prompt = keys_of(3, 40)
    store_in_l2_only(storage, prompt[:30], SIZE)
    handle, locked = storage.start_prefetch(prompt)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == 30
    objects = storage.read(prompt)
    assert [bytes(storage.view(obj)) for obj in objects] == [payload(key, SIZE) for key in prompt[:30]]
    storage.release(prompt[:30], 2)  # the read above and the prefetch's own lock
    assert_nothing_held(storage)


def test_an_adapter_that_cannot_answer_at_once_is_asked_about_every_key(engine: Engine) -> None:
    # A simulated latency makes the mock answer on its worker thread only.
    storage = engine([mock(), mock(latency_s=0.001, namespace="slow")])
    prompt = keys_of(4, 40)
    handle, locked = storage.start_prefetch(prompt)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == 0
    assert asked(storage, 1) == 40
    assert_nothing_held(storage)


def test_a_short_remainder_is_asked_about_whole(engine: Engine) -> None:
    storage = engine([mock()])
    _, locked = storage.start_prefetch(keys_of(5, PROBE_MIN_KEYS - 1))
    assert locked == [] and asked(storage) == PROBE_MIN_KEYS - 1


def test_a_repeat_where_l1_s_prefix_ends_keeps_that_prefix(engine: Engine) -> None:
    storage = engine([mock()])
    prompt = keys_of(6, 4)
    store(storage, prompt, SIZE)
    assert storage.flush(10)  # in L2 too: the first question past the prefix is a hit
    _, locked = storage.start_prefetch(prompt + prompt * 3)
    assert locked == prompt
    storage.release(locked)
    assert_nothing_held(storage)
