"""A key this server stored that another server sharing the pool stored again, under a
chain that differs only in a serde's options (so another record size): the lookup reads
the new record's header for its sizes, and the load hands out the new record's bytes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import config_for, open_adapter

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.serde import SerdeContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10


class Padding:
    """A size-changing serde whose option (the padding's length) changes the stored size
    only: it decodes the records of every padding, as zstd decodes every level's."""

    name = "test-padding"

    def __init__(self, pad: int) -> None:
        self.pad = pad

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(data) + b"\0" * self.pad + bytes([self.pad])

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        pad = data[-1]
        if bytes(data[-pad - 1 : -1]) != b"\0" * pad:
            raise ValueError("padding damaged")
        return bytes(data[: -pad - 1])


@pytest.fixture
def adapters() -> Iterator[list[BackendAdapter]]:
    opened: list[BackendAdapter] = []
    yield opened
    for adapter in opened:
        adapter.close()


def _store(adapter: BackendAdapter, keys: list[ObjectKey], seed: int) -> list[bytes]:
    data = [pattern(seed * 1000 + i, SIZE) for i in range(len(keys))]
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(d) for d in data]) == [True] * len(keys)
    return data


def _read(adapter: BackendAdapter, keys: list[ObjectKey]) -> list[bytes]:
    client = BlockingAdapterClient(adapter)
    result = client.lookup_and_lock(keys)
    assert result.found == [True] * len(keys), adapter.stats()
    try:
        assert result.sizes == [SIZE] * len(keys)
        buffers = [memoryview(bytearray(size)) for size in result.sizes]
        assert client.load(keys, buffers) == [True] * len(keys)
    finally:
        adapter.unlock(keys)
    return [bytes(buffer) for buffer in buffers]


def test_a_key_stored_again_by_another_server_under_another_record_size_is_read(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    config = config_for(mooncake_pool, master_metrics_url=None)
    first = open_adapter(config, serde=(Padding(3),))
    adapters.append(first)
    second = open_adapter(config, serde=(Padding(9),))
    adapters.append(second)
    keys = make_keys(3)
    _store(first, keys, seed=1)
    assert first.used_bytes() == 3 * (SIZE + 4)

    again = _store(second, keys, seed=2)
    assert _read(first, keys) == again, "the record stored again, sized from its header"
    assert first.used_bytes() == 3 * (SIZE + 10), "the accounting follows the object in the pool"

    # And back: the second server reads the first's record stored once more.
    latest = _store(first, keys, seed=3)
    assert _read(second, keys) == latest
    for adapter in (first, second):
        stats = adapter.stats()
        assert stats.get("lookup_size_unknown", 0) == 0
        assert stats.get("corrupt_records_removed", 0) == 0
