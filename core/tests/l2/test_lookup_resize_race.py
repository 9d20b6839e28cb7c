"""A lookup that finds an accounted key at another size (another writer stored it again)
accounts that size only if no store of this adapter replaced the key's entry while the
backend was being asked: the store's entry is the newer word on the object.  Overwritten
with the size read before the store landed, the usage would lose the difference for as
long as no other lookup of the key came, and the capacity would be overrun by it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from l2_backends import DictBackend, DictConfig, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, ObjectSize
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

FIRST, OTHERS, OURS = 1000, 2000, 3000


class ReadThenPause(DictBackend):
    """``contains_many`` reads its answer, tells ``read``, and returns it once ``answer`` is set."""

    def __init__(self, config: DictConfig, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.read = threading.Event()
        self.answer = threading.Event()
        self.pause = False

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        answer = super().contains_many(keys)
        if self.pause:
            self.read.set()
            assert self.answer.wait(10), "the test never let the lookup's answer through"
        return answer


def test_a_store_landing_while_a_lookup_reads_another_size_keeps_its_entry(
    adapters: list[BackendAdapter],
) -> None:
    adapter = open_dict(ReadThenPause)
    adapters.append(adapter)
    backend = adapter.backend
    assert isinstance(backend, ReadThenPause)
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter)
    assert client.store(keys, [memoryview(bytes(FIRST))]) == [True]
    backend.objects[keys[0]] = bytes(OTHERS)  # another writer stored the key again
    backend.pause = True
    found: list[list[int]] = []
    lookup = threading.Thread(target=lambda: found.append(client.lookup_and_lock(keys).sizes))
    lookup.start()
    try:
        assert backend.read.wait(10), "the lookup never read the backend"
        # This adapter stores the key again after the lookup read the other writer's size.
        assert client.store(keys, [memoryview(bytes(OURS))]) == [True]
    finally:
        backend.answer.set()
        lookup.join(10)
    assert len(backend.objects[keys[0]]) == OURS
    assert adapter.state.accounting.get(keys[0]) == ObjectSize(OURS, OURS)
    assert adapter.used_bytes() == OURS
    assert found == [[OURS]], "answered with the object now stored, which a load of it finds"
    adapter.unlock(keys)
