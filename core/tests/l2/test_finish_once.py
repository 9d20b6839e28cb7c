"""An op's ``finish`` runs exactly once on every path of an event loop's task: what its
``prepare`` took (pins, a load's registration for noting layouts) is always handed back,
never twice, whether the task ends normally, raises, is cancelled or is closed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from l2_backends import AsyncDictBackend, open_dict

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.ops import LoadOp
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

SIZE = 1000


def stored_adapter(adapters: list[BackendAdapter]) -> tuple[BackendAdapter, BlockingAdapterClient, list[Any]]:
    adapter = open_dict(AsyncDictBackend)
    adapters.append(adapter)
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store(keys, [memoryview(bytes(SIZE))]) == [True]
    return adapter, client, keys


def nothing_held(adapter: BackendAdapter) -> bool:
    state = adapter.state
    return not state.pins.snapshot() and not state._loading


class BrokenArguments:
    """Call arguments whose unpacking raises: an op's bug after its ``prepare`` took pins."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("a bug in an op, after its prepare")


def test_an_op_raising_after_prepare_hands_back_what_prepare_took(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, client, keys = stored_adapter(adapters)
    prepare = LoadOp.prepare

    def prepare_then_break(op: LoadOp) -> Any:
        prepare(op)
        return BrokenArguments()

    monkeypatch.setattr(LoadOp, "prepare", prepare_then_break)
    assert client.load(keys, [memoryview(bytearray(SIZE))]) == [False]
    monkeypatch.undo()
    assert adapter.stats().get("tasks_crashed") == 1
    assert nothing_held(adapter), "the load's pin and noting registration were handed back"
    # The key is evictable again: a delete claims it.
    assert adapter.delete(keys) == [True]
