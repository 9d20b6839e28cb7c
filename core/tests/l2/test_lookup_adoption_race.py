"""A lookup adopts (accounts, counts as ``lookup_adopted`` and announces as stored) only a
key it accounted itself: one a store accounted while the backend was being asked was
announced by that store, and a second ``on_l2_keys_stored`` would read to an eviction
policy as a second use of the key (ARC moves it to its frequent list, S3-FIFO counts a
read), keeping a key written once longer than keys used more."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from l2_backends import DictBackend, DictConfig, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, ObjectSize
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.l2_support import RecordingListener

SIZE = 4096


class PausingLookups(DictBackend):
    """Answers ``contains_many`` only once ``answer`` is set, after telling ``asked``."""

    def __init__(self, config: DictConfig, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.asked = threading.Event()
        self.answer = threading.Event()

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        self.asked.set()
        assert self.answer.wait(10), "the test never let the lookup's answer through"
        return super().contains_many(keys)


def test_a_key_a_store_accounted_during_a_lookup_is_announced_once(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(PausingLookups)
    adapters.append(adapter)
    backend = adapter.backend
    assert isinstance(backend, PausingLookups)
    listener = RecordingListener()
    adapter.add_listener(listener)
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter)
    found: list[list[bool]] = []
    lookup = threading.Thread(target=lambda: found.append(client.lookup_and_lock(keys).found))
    lookup.start()
    try:
        assert backend.asked.wait(10), "the lookup never asked the backend"
        # Not accounted when the lookup began; stored (accounted, announced) before it is answered.
        assert client.store(keys, [memoryview(bytearray(SIZE))]) == [True]
    finally:
        backend.answer.set()
        lookup.join(10)
    assert found == [[True]]
    adapter.unlock(keys)

    assert listener.keys("stored") == keys, "announced by its store, not again by the lookup"
    assert "lookup_adopted" not in adapter.stats()
    assert adapter.used_bytes() == SIZE
