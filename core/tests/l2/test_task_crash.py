"""An op that raises (a bug, not a backend failure) fails its task -- on worker threads and
on an event loop alike -- instead of leaving its caller waiting for a result for ever."""

from __future__ import annotations

import pytest
from l2_backends import AsyncDictBackend, DictBackend, open_dict

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.ops import LoadOp
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

SIZE = 1000


@pytest.mark.parametrize("where", ["prepare", "finish"])
@pytest.mark.parametrize("backend", [DictBackend, AsyncDictBackend], ids=["plain", "coroutines"])
def test_an_op_that_raises_fails_its_task(
    adapters: list[BackendAdapter], backend: type[DictBackend], where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = open_dict(backend)
    adapters.append(adapter)
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store(keys, [memoryview(bytes(SIZE))]) == [True]
    assert client.lookup_and_lock(keys).found == [True]

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug in an op")

    monkeypatch.setattr(LoadOp, where, broken)
    assert client.load(keys, [memoryview(bytearray(SIZE))]) == [False]
    monkeypatch.undo()
    assert client.load(keys, [memoryview(bytearray(SIZE))]) == [True], "the adapter goes on"
    adapter.unlock(keys)
