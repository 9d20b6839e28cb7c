"""The keys a delete found holding another type than a record's string are remembered for
the lookup core makes right after (so it does not count them again) -- and never more of
them than a fixed number: that lookup may never come, and each delete of such a key would
otherwise stay in memory for good.  The oldest are forgotten, counted, and their next
lookup counts what it finds once more."""

from __future__ import annotations

from collections.abc import Callable

import redis
from lmcache_plugin_redis.backend import RedisBackend
from lmcache_plugin_redis.testing import RedisServer

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.context import KEPT_MARKS_LIMIT
from lmcache_tiers.testing.l2 import make_keys


def test_marks_of_foreign_objects_deletes_found_are_bounded_the_oldest_forgotten_and_counted(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    backend = adapter.backend
    backend = getattr(backend, "inner", backend)  # behind the circuit breaker
    assert isinstance(backend, RedisBackend)
    keys = make_keys(KEPT_MARKS_LIMIT + 1)
    raw = redis.Redis.from_url(redis_server.url)
    with raw.pipeline(transaction=False) as pipe:
        for key in keys:  # another party's hashes under this server's names
            pipe.hset(backend.name_of(key), "field", b"somebody else's hash")
        pipe.execute()
    # Deletes that no lookup follows (an eviction's keys pinned meanwhile, a close).
    assert backend.delete_many(keys) == [False] * len(keys)
    stats = adapter.stats()
    assert stats["foreign_objects"] == len(keys), "each counted once, by its delete"
    assert len(backend._foreign_by_delete) == KEPT_MARKS_LIMIT, "the marks grew past their bound"
    assert stats["foreign_delete_marks_forgotten"] == 1
    # The oldest mark was forgotten: its lookup counts the hash again (a miss either
    # way); the newest key's lookup still does not.
    first, last = keys[0], keys[-1]
    assert backend.contains_many([first]) == [None]
    assert adapter.stats()["foreign_objects"] == len(keys) + 1
    assert backend.contains_many([last]) == [None]
    assert adapter.stats()["foreign_objects"] == len(keys) + 1
    raw.delete(*(backend.name_of(key) for key in keys))
