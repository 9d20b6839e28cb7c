"""Loads into L1 read under Mooncake get sessions, which the client keeps one per name
whoever started them: loads of the same keys running at once must not end each other's
sessions under their reads.  Against a real master."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator

import pytest
from lmcache_plugin_mooncake.cluster import LocalCluster
from lmcache_plugin_mooncake.headers import HEADER_BYTES, address_of
from mooncake_helpers import backend_of, config_for

from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 256 << 10
KEYS = 4
THREADS = 4
ROUNDS = 40


@pytest.fixture
def arena() -> memoryview:
    # the stored payloads, then one target per thread and key
    return memoryview(mmap.mmap(-1, (1 + THREADS) * KEYS * SIZE))


@pytest.fixture
def adapter(mooncake_pool: LocalCluster, arena: memoryview) -> Iterator[BackendAdapter]:
    from lmcache_plugin_mooncake.backend import MooncakeStoreBackend

    config = config_for(mooncake_pool)
    context = AdapterContext(index=0, name="0:mooncake_store", config=config, l1_buffer=arena)
    opened = create_adapter(MooncakeStoreBackend, config, context)
    assert isinstance(opened, BackendAdapter)
    yield opened
    opened.close()


def test_loads_of_the_same_keys_at_once_all_hit_and_end_every_session(
    adapter: BackendAdapter, arena: memoryview
) -> None:
    """Threads loading the same keys over and over (batches in rotated orders, so their
    sessions start and end interleaved) all read every record whole and verified; once
    they are done no session is left open in the client."""
    keys = make_keys(KEYS)
    data = [pattern(i, SIZE) for i in range(KEYS)]
    sources = [arena[i * SIZE : (i + 1) * SIZE] for i in range(KEYS)]
    for source, payload in zip(sources, data, strict=True):
        source[:] = payload
    assert BlockingAdapterClient(adapter).store(keys, sources) == [True] * KEYS
    backend = backend_of(adapter)
    assert backend.connection.l1_registered, "loads into L1 read under sessions"
    failures: list[str] = []

    def load_repeatedly(thread: int) -> None:
        base = (1 + thread) * KEYS * SIZE
        targets = [arena[base + i * SIZE : base + (i + 1) * SIZE] for i in range(KEYS)]
        for round_ in range(ROUNDS):
            order = [(round_ + thread + i) % KEYS for i in range(KEYS)][: 1 + (round_ + thread) % KEYS]
            ok = backend.get_many_into([keys[i] for i in order], [targets[i] for i in order])
            if ok != [True] * len(order):
                failures.append(f"thread {thread} round {round_}: {ok}")
            for i in order:
                if bytes(targets[i]) != data[i]:
                    failures.append(f"thread {thread} round {round_}: key {i} read other bytes")

    threads = [threading.Thread(target=load_repeatedly, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert adapter.stats().get("load_failures", 0) == 0
    assert backend._sessions.open == 0
    # every session ended in the client too: a read under none is refused (-600)
    store, slot = backend.connection.store(), arena[KEYS * SIZE :]
    with backend.lanes.lane(5.0) as lane:
        codes = store.batch_get_into_multi_buffer_ranges(
            [backend.names.of(keys[0])],
            [[lane.address(0), address_of(slot[:SIZE])]],
            [[HEADER_BYTES, SIZE]],
            [[0, HEADER_BYTES]],
        )
    assert codes[0] < 0, "a session was left open in the client"
