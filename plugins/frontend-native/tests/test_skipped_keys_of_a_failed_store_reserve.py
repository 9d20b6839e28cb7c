"""A STORE_RESERVE that skips some of its keys (L1 has them already) and then raises while
its reply is built is refused whole: the client is told nothing of its slots, and every
key it named is counted once, as refused under the error's code.  Its skipped keys were
counted as skipped before the reply's slots were built, then as refused with the rest of
the request: one key counted twice, so stored + skipped + refused overran the keys sent.
The step that raises is made to by the test."""

from __future__ import annotations

import os
from typing import Any

import pytest
from native_keys import keys_accounted, keys_of, stats_of

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.server.app import TiersServer

CHUNK = 4096


def test_the_skipped_keys_of_a_store_reserve_that_raised_are_counted_once(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    present, new = keys_of(2)
    with Client(server.endpoint, timeout=30) as client:
        assert client.uses_shm
        assert client.store([present], [os.urandom(CHUNK)]) == 1
        l1 = server.storage.l1

        def fail(*args: Any) -> None:
            monkeypatch.undo()
            raise MemoryError("made to fail while the reply's slots are built")

        # Asked only once the keys L1 did not reserve were looked at: ``present`` skipped.
        monkeypatch.setattr(l1, "generations", fail)
        with pytest.raises(ServerError, match="INTERNAL"):
            client.store([present, new], [os.urandom(CHUNK)] * 2)

    stats = stats_of(server)
    assert stats.store_keys_refused["internal"] == 2
    assert stats.store_keys_skipped["present"] == 0, "a key of the refused store counted as skipped too"
    assert keys_accounted(server) == 3  # one stored, then two refused
