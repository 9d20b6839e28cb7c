"""A prefetch result nobody collects is counted ``prefetch_result_expired`` once.

The front end gives back a result its client did not collect by its deadline, counted,
when its sweep (every 0.2 s or so) finds it.  The storage keeps the result for the front
end until then: had it expired the result itself first -- one landing within a sweep of
its deadline -- the front end would find it gone (0 hits) and count it again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lmcache_plugin_frontend_native.handlers import DataPlane, Handlers

from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.wire import protocol as p

SIZE = 4096
KEYS = [ObjectKey("expiry", 0, index.to_bytes(8, "big")) for index in range(4)]
CLIENT = b"client"
WAIT_S = 30.0


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    registry = load_registry()
    adapter = decode_adapter(registry, {"type": "mock", "max_size_gb": 0.01}, 0)
    manager = StorageManager(ServerConfig(l1_size_gb=0.01, l2_adapters=(adapter,)), registry)
    try:
        reserved = manager.reserve_write(KEYS, [SIZE] * len(KEYS))
        for obj in reserved.values():
            manager.view(obj)[:] = b"x" * SIZE
        manager.commit_write(list(reserved))
        assert manager.flush(WAIT_S)
        manager.clear()  # in L2 only: a lookup of them prefetches
        yield manager
    finally:
        manager.close()


def test_a_result_landing_just_before_its_deadline_is_counted_expired_once(storage: StorageManager) -> None:
    handlers = Handlers(
        storage,
        chunk_size=256,
        data_plane=DataPlane(),
        stats=FrontendStats(),
        status_provider=dict,
        max_inline_bytes=1 << 20,
    )
    answer = handlers.lookup(p.Lookup(1, "", KEYS), CLIENT, ())
    assert isinstance(answer, tuple) and answer[0].hits is None, "the prefetch goes to L2"
    session = handlers.sessions.peek(CLIENT)
    assert session is not None
    ((handle, pending),) = session.prefetches.items()
    handles = storage.prefetch._handles
    with handles._done:  # the result lands, the front end's sweep not having seen it
        assert handles._done.wait_for(lambda: handle in handles._results, WAIT_S)
    # Both deadlines run from the LOOKUP's arrival, the storage's a hair later.
    past_deadline = pending.deadline + 1.0
    handles.expire(past_deadline)  # the storage's controller reaches the deadline first
    handlers.collect_prefetches(past_deadline)  # then the front end's sweep

    expired = handlers.stats.failures["prefetch_result_expired"] + storage.stats.failures().get(
        "prefetch_result_expired", 0
    )
    assert expired == 1, "one result, counted once"
    assert not session.prefetches
    objects = [storage.l1.get(key) for key in KEYS]
    assert all(obj is None or obj.read_locks == 0 for obj in objects), "its locks were given back"
