"""fault_inject's ``rate`` and ``seed`` as LMCache means them: ``rate`` is the share of keys
whose loads fail, each key chosen by a hash of the key and ``seed``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from lmcache_plugin_fault_inject import FaultInjectConfig
from lmcache_plugin_fault_inject.backend import open_fault_inject, rate_chooses

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64


@pytest.fixture
def opened() -> Iterator[list[BackendAdapter]]:
    adapters: list[BackendAdapter] = []
    yield adapters
    for adapter in adapters:
        adapter.close()


def open_fault(opened: list[BackendAdapter], **settings: Any) -> BackendAdapter:
    settings.setdefault("inner", {"type": "mock", "namespace": uuid.uuid4().hex})
    config = FaultInjectConfig(**settings)
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    adapter = create_adapter(open_fault_inject, config, context)
    assert isinstance(adapter, BackendAdapter)
    opened.append(adapter)
    return adapter


def stored(adapter: BackendAdapter, keys: list[ObjectKey]) -> list[bytes]:
    """``keys`` stored through the wrapper: ``rate`` never fails a store."""
    data = [pattern(i, SIZE) for i in range(len(keys))]
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(d) for d in data]) == [True] * len(keys)
    return data


def loaded(adapter: BackendAdapter, keys: list[ObjectKey], data: list[bytes]) -> list[bool]:
    """Look ``keys`` up (every one is found) and load them in one batch: which loaded.

    A key that loaded has its own bytes; one that failed has its buffer untouched."""
    client = BlockingAdapterClient(adapter)
    assert client.lookup_and_lock(keys).found == [True] * len(keys), "rate never fails a lookup"
    targets = [memoryview(bytearray(SIZE)) for _ in keys]
    outcome = client.load(keys, targets)
    adapter.unlock(keys)
    for done, target, expected in zip(outcome, targets, data, strict=True):
        assert bytes(target) == (expected if done else bytes(SIZE))
    return outcome


def test_a_key_the_rate_chose_fails_every_load_of_every_adapter_with_that_seed(
    opened: list[BackendAdapter],
) -> None:
    keys = make_keys(64)
    first, second = open_fault(opened, seed=7, rate=0.3), open_fault(opened, seed=7, rate=0.3)
    data = stored(first, keys)
    stored(second, keys)
    outcome = loaded(first, keys, data)
    assert 0 < outcome.count(False) < 64
    assert loaded(first, keys, data) == outcome, "the same keys fail at every load"
    assert loaded(second, keys, data) == outcome, "and in another adapter with the same seed"
    in_pairs = [loaded(first, keys[i : i + 2], data[i : i + 2]) for i in range(0, 64, 2)]
    assert [done for pair in in_pairs for done in pair] == outcome, "whatever the batches"
    other = open_fault(opened, seed=8, rate=0.3)
    stored(other, keys)
    assert loaded(other, keys, data) != outcome, "another seed chooses other keys"


def test_another_process_chooses_the_same_keys(opened: list[BackendAdapter]) -> None:
    """A hash of the key's bytes, not Python's ``hash()`` (salted per process) nor a
    random sequence: another process with the same seed fails the same keys."""
    keys = make_keys(64, salt="s")
    adapter = open_fault(opened, seed=12, rate=0.25)
    outcome = loaded(adapter, keys, stored(adapter, keys))
    script = (
        "import json\n"
        "from lmcache_plugin_fault_inject.backend import rate_chooses\n"
        "from lmcache_tiers.testing.l2 import make_keys\n"
        "print(json.dumps([rate_chooses(12, 0.25, key) for key in make_keys(64, salt='s')]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4321"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert json.loads(run.stdout) == [not done for done in outcome]


@pytest.mark.parametrize("fail_mode", ["keys", "batch", "raise"])
def test_the_rate_fails_loads_alone_key_by_key_in_every_fail_mode(
    opened: list[BackendAdapter], fail_mode: str
) -> None:
    """Each chosen key is a load failure of that key -- a hole in the found prefix --
    never a failed call, a failed store or a missed lookup."""
    keys = make_keys(32)
    adapter = open_fault(opened, seed=1, rate=0.5, fail_mode=fail_mode)
    outcome = loaded(adapter, keys, stored(adapter, keys))
    assert outcome == [not rate_chooses(1, 0.5, key) for key in keys]
    assert 0 < outcome.count(False) < 32
    stats = adapter.stats()
    assert stats["injected_rate_failures"] == outcome.count(False)
    assert stats.get("backend_errors", 0) == 0
    assert stats.get("injected_store_failures", 0) == stats.get("injected_lookup_failures", 0) == 0


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.75, 1.0])
def test_the_share_of_keys_whose_loads_fail_is_the_rate(opened: list[BackendAdapter], rate: float) -> None:
    keys = make_keys(2000)
    adapter = open_fault(opened, seed=5, rate=rate)
    data = stored(adapter, keys)
    failed = sum(loaded(adapter, keys[i : i + 8], data[i : i + 8]).count(False) for i in range(0, 2000, 8))
    assert abs(failed / 2000 - rate) < 0.04
    assert adapter.stats().get("injected_rate_failures", 0) == failed


def test_each_key_a_load_loses_is_counted_once_and_logged(
    opened: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    keys = make_keys(2)
    drawn = open_fault(opened, rate=1.0, load_fail_rate=1.0)
    assert loaded(drawn, keys, stored(drawn, keys)) == [False, False]
    stats = drawn.stats()
    assert (stats["injected_load_failures"], stats.get("injected_rate_failures", 0)) == (2, 0)

    gapped = open_fault(opened, seed=4, rate=1.0, gap_indices=(0,))
    with caplog.at_level(logging.WARNING):
        assert loaded(gapped, keys, stored(gapped, keys)) == [False, False]
    stats = gapped.stats()
    assert (stats["injected_rate_failures"], stats.get("injected_load_gaps", 0)) == (2, 0)
    assert "injected load failure of 2/2 keys chosen by rate 1 (seed 4)" in caplog.text
