"""The start-up listing reads the record header of each listed object to tell other
writers' records apart, then judges it.  A read given up at ``operation_timeout_s`` goes
on in Mooncake and judges what it read when it returns -- possibly after a store of the
key landed and replaced that record.  The listing must count as a reader of the key's
record for as long as it runs, so that an old record of another serde chain does not
mark the key a miss over the store's record (nor another key's release the store's
entry)."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
from lmcache_plugin_mooncake import backend as mooncake_backend
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import Xor, backend_of, config_for, open_adapter

from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.threads import DEADLINE_S, wait_until

SIZE = 4096


def test_a_store_landing_before_a_listing_header_read_left_at_its_deadline_judges_stays_readable(
    mooncake_pool: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_for(mooncake_pool)
    [key] = make_keys(1)
    writer = open_adapter(msgspec.structs.replace(config, master_metrics_url=None), serde=(Xor(),))
    try:
        assert BlockingAdapterClient(writer).store([key], [memoryview(pattern(1, SIZE))]) == [True]
        name = backend_of(writer).names.of(key)
    finally:
        writer.close()

    read = threading.Event()
    judge = threading.Event()
    real_read_headers = mooncake_backend._read_headers

    def read_then_wait(store: Any, lane: Any, names: list[str]) -> list[int]:
        """The listing's read of the header, held past its deadline before it is judged."""
        codes = real_read_headers(store, lane, names)
        if name in names and not read.is_set():
            read.set()
            assert judge.wait(DEADLINE_S), "the test never let the listing judge"
        return codes

    monkeypatch.setattr(mooncake_backend, "_read_headers", read_then_wait)
    # No serde: the listed record is of another chain.  The listing's header read is
    # given up at its deadline while the adapter is built (the object is not listed).
    restarted = open_adapter(config)
    try:
        assert read.is_set(), "the listing never read the record's header"
        assert restarted.stats().get("listing_header_read_failures") == 1
        client = BlockingAdapterClient(restarted)
        data = pattern(2, SIZE)
        assert client.store([key], [memoryview(data)]) == [True]
        judge.set()
        # The read left behind judges the record the store replaced: counted ...
        wait_until(lambda: restarted.stats().get("serde_chain_mismatch") == 1, "the listing to judge")

        # ... without marking the key a miss over the store's record.
        result = client.lookup_and_lock([key])
        assert result.found == [True], "the store's record is readable"
        buffer = memoryview(bytearray(SIZE))
        try:
            assert client.load([key], [buffer]) == [True]
        finally:
            restarted.unlock([key])
        assert bytes(buffer) == data
    finally:
        judge.set()
        restarted.close()
