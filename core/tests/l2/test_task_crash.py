"""An op that raises (a bug, not a backend failure) fails its task -- on worker threads and
on an event loop alike -- instead of leaving its caller waiting for a result for ever."""

from __future__ import annotations

import asyncio

import pytest
from l2_backends import AsyncDictBackend, DictBackend, open_dict

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.ops import LoadOp
from lmcache_tiers.l2.state import AdapterState
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
    # Counted, not only logged: the load fails as a backend failure would, and a bug
    # would otherwise look like one on /metrics.
    assert adapter.stats().get("tasks_crashed") == 1
    monkeypatch.undo()
    assert client.load(keys, [memoryview(bytearray(SIZE))]) == [True], "the adapter goes on"
    adapter.unlock(keys)


class Abort(BaseException):
    """Not an ``Exception`` either."""


class CancelledInside(DictBackend):
    """Plain methods that run coroutines of their own: a coroutine cancelled inside the
    call surfaces as ``asyncio.CancelledError``, which is no ``Exception``."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.cancel_in = ""
        self.error: type[BaseException] = asyncio.CancelledError

    def put_many(self, keys, payloads):  # type: ignore[no-untyped-def]
        if self.cancel_in == "put_many":
            raise self.error
        return super().put_many(keys, payloads)

    def get_many_into(self, keys, buffers):  # type: ignore[no-untyped-def]
        if self.cancel_in == "get_many_into":
            raise self.error
        return super().get_many_into(keys, buffers)


@pytest.mark.parametrize("error", [asyncio.CancelledError, Abort])
@pytest.mark.parametrize("method", ["put_many", "get_many_into"])
def test_a_backend_call_raising_a_base_exception_leaves_nothing_held(
    adapters: list[BackendAdapter], method: str, error: type[BaseException]
) -> None:
    adapter = open_dict(CancelledInside, capacity=10 * SIZE)
    adapters.append(adapter)
    backend: CancelledInside = adapter.backend  # type: ignore[assignment]
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store(keys, [memoryview(bytes(SIZE))]) == [True]
    backend.cancel_in, backend.error = method, error
    if method == "put_many":
        assert client.store(keys, [memoryview(bytes(SIZE))]) == [False]
    else:
        assert client.load(keys, [memoryview(bytearray(SIZE))]) == [False]
    backend.cancel_in = ""
    assert adapter.pinned_keys() == {}
    assert adapter.state.pins.writers() == {}
    assert adapter.state.accounting._reserved_bytes == 0
    assert adapter.delete(keys) == [True], "no claim of the failed call keeps the key"


@pytest.mark.parametrize("backend", [DictBackend, AsyncDictBackend], ids=["plain", "coroutines"])
def test_a_store_whose_prepare_raises_after_admission_gives_the_capacity_back(
    adapters: list[BackendAdapter], backend: type[DictBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = open_dict(backend, capacity=2 * SIZE)
    adapters.append(adapter)
    keys = make_keys(2)
    client = BlockingAdapterClient(adapter, timeout=10.0)

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug after the capacity check")

    monkeypatch.setattr(AdapterState, "storing_begin", broken)
    assert client.store(keys, [memoryview(bytes(SIZE)) for _ in keys]) == [False, False]
    monkeypatch.undo()
    assert adapter.state.accounting._reserved_bytes == 0
    assert adapter.state.pins.writers() == {}
    assert client.store(keys, [memoryview(bytes(SIZE)) for _ in keys]) == [True, True], "the capacity is free"
