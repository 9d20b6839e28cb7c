"""A delete whose removal the master did not answer (-900) marks the master silent, as
every other call's unanswered code does: the calls after it probe the master first
instead of each sitting through Mooncake's reconnect."""

from __future__ import annotations

from typing import Any

import pytest
from lmcache_plugin_mooncake.backend import PROBE_NAME
from lmcache_plugin_mooncake.client import MasterUnreachable
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import backend_of, config_for, open_adapter

from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10
#: what Mooncake answers when its master RPC failed
MASTER_RPC_FAILED = -900


class _RemovalsUnanswered:
    """The adapter's client, except that the master answers no batch removal; records
    the names of the existence queries."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.queried: list[str] = []

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def batch_remove(self, names: list[str], force: bool) -> list[int]:
        return [MASTER_RPC_FAILED] * len(names)

    def batch_is_exist(self, names: list[str]) -> list[int]:
        self.queried.extend(names)
        return self._store.batch_is_exist(names)  # type: ignore[no-any-return]


def test_a_delete_the_master_did_not_answer_marks_it_silent(mooncake_pool: LocalCluster) -> None:
    adapter = open_adapter(config_for(mooncake_pool))
    try:
        backend = backend_of(adapter)
        client = BlockingAdapterClient(adapter)
        (key,) = make_keys(1)
        assert client.store([key], [memoryview(pattern(3, SIZE))]) == [True]
        unanswered = _RemovalsUnanswered(backend.connection.store())
        backend.connection.store = lambda: unanswered  # type: ignore[method-assign]
        try:
            with pytest.raises(MasterUnreachable):  # the whole batch fails, as other calls'
                backend.delete_many([key])
            assert backend._master_silent.is_set(), "the unanswered removal did not mark the master silent"
            # So the next lookup probes the master before its own call.
            assert backend.contains_many([key]) != [None]
        finally:
            del backend.connection.store
        assert unanswered.queried[0] == PROBE_NAME
        assert not backend._master_silent.is_set(), "the master answered the probe"
    finally:
        adapter.close()
