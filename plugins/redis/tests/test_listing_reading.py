"""The start-up listing reads the head of each listed value to size the record, then
judges that header with ``read_record_header`` -- which marks a key whose record is of
another serde chain a miss until it is replaced.  A store of the key through this adapter
may land between the read and the judgment: the listing must count as a reader of the
key's record meanwhile, so that the old record does not mark the key a miss over the
store's own (nor, of a newer format, release the store's entry)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from lmcache_plugin_redis.backend import NAME_LIMIT, RedisBackend
from lmcache_plugin_redis.testing import RedisServer

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2 import scan as scan_module
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.plugin import key_to_name
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.threads import DEADLINE_S, wait_until

SIZE = 4096


def test_a_store_landing_between_a_listing_header_read_and_its_judgment_stays_readable(
    redis_server: RedisServer,
    prefix: str,
    open_adapter: Callable[..., BackendAdapter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    [key] = make_keys(1)
    name = prefix + key_to_name(key, NAME_LIMIT)
    old = pattern(1, SIZE)
    # A record of this key written under another serde chain (an earlier run's).
    redis.Redis.from_url(redis_server.url).set(name, encode_header(key, old, serde=("zstd",)) + old)

    read = threading.Event()
    judge = threading.Event()
    real_execute = RedisBackend._execute

    def execute_then_wait(self: RedisBackend, pipe: Any, *, per_key: bool = False) -> list[Any]:
        """The listing's read of the heads, held before they are judged."""
        replies = real_execute(self, pipe, per_key=per_key)
        if threading.current_thread().name.endswith("-listing") and not read.is_set():
            read.set()
            assert judge.wait(DEADLINE_S), "the test never let the listing judge"
        return replies

    monkeypatch.setattr(RedisBackend, "_execute", execute_then_wait)
    # The whole listing on the scan's own thread, none of it while the adapter is built.
    monkeypatch.setattr(scan_module, "FOREGROUND_ENTRIES", 0)
    adapter = open_adapter(url=redis_server.url, key_prefix=prefix)
    try:
        wait_until(read.is_set, "the listing to read the record's head")
        client = BlockingAdapterClient(adapter)
        data = pattern(2, SIZE)
        assert client.store([key], [memoryview(data)]) == [True]
    finally:
        judge.set()
    # The listing judges the record the store replaced: counted ...
    wait_until(lambda: not adapter.stats()["scan_running"], "the start-up scan to end")
    assert adapter.stats().get("serde_chain_mismatch") == 1

    # ... without marking the key a miss over the store's record.
    result = client.lookup_and_lock([key])
    assert result.found == [True], "the store's record is readable"
    buffer = memoryview(bytearray(SIZE))
    try:
        assert client.load([key], [buffer]) == [True]
    finally:
        adapter.unlock([key])
    assert bytes(buffer) == data
