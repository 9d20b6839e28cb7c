"""A damaged record whose removal the pool refuses: a miss, kept, and counted as not removed."""

from __future__ import annotations

from typing import Any

from lmcache_plugin_mooncake.cluster import LocalCluster
from lmcache_plugin_mooncake.headers import HEADER_BYTES
from mooncake_helpers import backend_of, config_for, open_adapter

from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10
#: what Mooncake answers when its master RPC failed
MASTER_RPC_FAILED = -900


class _RemoveFails:
    """The adapter's client, except that every removal of one object fails."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.removals: list[str] = []

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def remove(self, name: str, force: bool) -> int:
        self.removals.append(name)
        return MASTER_RPC_FAILED


def test_a_damaged_record_whose_removal_fails_is_not_counted_removed(
    mooncake_pool: LocalCluster, raw: Any
) -> None:
    # corrupt_records_removed says the object is gone from the pool; one whose removal
    # failed is still there (a miss at every load), which its own counter must say.
    adapter = open_adapter(config_for(mooncake_pool))
    try:
        backend = backend_of(adapter)
        (key,) = make_keys(1)
        name = backend.names.of(key)
        payload = pattern(7, SIZE)
        record = bytearray(encode_header(key, payload, align=HEADER_BYTES) + payload)
        record[HEADER_BYTES + 1000] ^= 0x01
        assert raw.put(name, bytes(record)) == 0
        real = backend.connection.store()
        failing = _RemoveFails(real)
        backend.connection.store = lambda: failing  # type: ignore[method-assign]
        try:
            buffer = memoryview(bytearray(SIZE))
            assert BlockingAdapterClient(adapter).load([key], [buffer]) == [False]
        finally:
            del backend.connection.store
        assert failing.removals == [name], "the damage was judged and its removal tried"
        assert raw.is_exist(name) == 1, "still in the pool"
        stats = adapter.stats()
        assert stats.get("corrupt_records_removed", 0) == 0, "counted removed though it was not"
        assert stats["corrupt_remove_failures"] == 1
    finally:
        adapter.close()
