"""An inner lookup given up at ``lookup_timeout_s`` keeps running on its helper thread and
may judge what it read after a store of the key landed: the store must count as one that
ran while the object was read.  Otherwise an object of another serde chain, read before
the store replaced it, marks the key a miss until replaced although the store's object is
the one there (and another key's record, read the same way, would have the store's entry
released)."""

from __future__ import annotations

import threading
import types
import uuid
from collections.abc import Sequence
from typing import Any

from lmcache_plugin_fault_inject import FaultInjectConfig
from lmcache_plugin_fault_inject.backend import open_fault_inject
from lmcache_plugin_mock import MockConfig
from lmcache_plugin_mock.backend import MockBackend

from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import KindRegistry
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.serde import Reversed
from lmcache_tiers.testing.threads import DEADLINE_S, wait_until

KEY = ObjectKey("llama", 0, b"\x01" * 16)
SIZE = 4096


class SlowJudge(MockBackend):
    """The mock; a lookup made while ``hold`` is set reads the objects, then waits for
    ``judge`` before judging them (one of another serde chain: a miss, marked)."""

    hold = False
    read = threading.Event()
    judge = threading.Event()
    judged = threading.Event()

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        with self._objects.lock:
            found = [self._objects.data.get(key) for key in keys]
        held = SlowJudge.hold
        if held:
            SlowJudge.read.set()
            assert SlowJudge.judge.wait(DEADLINE_S), "the test never let the left lookup judge"
        readable = self._readable(keys, found)
        if held:
            SlowJudge.judged.set()
        return [obj.size if obj is not None and ok else None for obj, ok in zip(found, readable, strict=True)]


@hookimpl(specname="tiers_register_l2_adapters")
def _register(registry: KindRegistry) -> None:
    registry.add("slow_judge_mock", SlowJudge, MockConfig)


def _store_with_another_chain(namespace: str) -> None:
    config = MockConfig(namespace=namespace)
    context = AdapterContext(index=0, name="0:mock", config=config, serde=(Reversed(),))
    adapter = create_adapter(MockBackend, config, context)
    try:
        assert BlockingAdapterClient(adapter).store([KEY], [memoryview(bytes(SIZE))]) == [True]
    finally:
        adapter.close()


def test_a_store_landing_under_an_inner_lookup_left_at_its_timeout_stays_readable() -> None:
    module = types.ModuleType("fault_inject_left_lookup_reading_test")
    module.tiers_register_l2_adapters = _register  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-left-lookup-reading-test": module}).registry
    namespace = uuid.uuid4().hex
    _store_with_another_chain(namespace)
    config = FaultInjectConfig(
        inner={"type": "slow_judge_mock", "namespace": namespace}, lookup_timeout_s=0.05
    )
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    for event in (SlowJudge.read, SlowJudge.judge, SlowJudge.judged):
        event.clear()
    SlowJudge.hold = True
    adapter: Any = create_adapter(open_fault_inject, config, context, registry=registry)
    assert isinstance(adapter, BackendAdapter)
    try:
        client = BlockingAdapterClient(adapter)
        # The scan accounts the object first: a store while it runs would be refused.
        wait_until(lambda: not adapter.stats().get("scan_running", 0), "the start-up scan to finish")
        assert client.lookup_and_lock([KEY]).found == [False], "given up at its timeout: a miss"
        assert SlowJudge.read.is_set()
        assert adapter.stats().get("inner_lookup_timeouts") == 1
        SlowJudge.hold = False
        # Stored again, under this adapter's chain, while the lookup left behind still reads.
        assert client.store([KEY], [memoryview(bytes(SIZE))]) == [True]
        SlowJudge.judge.set()
        assert SlowJudge.judged.wait(DEADLINE_S)

        # The left lookup judged the object the store replaced: counted, but the key is
        # not marked a miss over the store's object.
        assert adapter.stats().get("serde_chain_mismatch") == 1
        assert client.lookup_and_lock([KEY]).found == [True], "the store's object is readable"
        adapter.unlock([KEY])
    finally:
        SlowJudge.hold = False
        SlowJudge.judge.set()
        adapter.close()
