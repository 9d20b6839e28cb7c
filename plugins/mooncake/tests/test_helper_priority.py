"""Checksums of a batch run partly on helper threads: each at the priority of the calls
they help, whichever kind of call needed a helper first."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from lmcache_plugin_mooncake import backend as backend_module
from lmcache_plugin_mooncake.backend import PARALLEL_MIN_BYTES
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import config_for, open_adapter

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern


def _nice() -> int:
    """The calling thread's nice value (Linux keeps one per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture
def adapter(mooncake_pool: LocalCluster) -> Iterator[BackendAdapter]:
    opened = open_adapter(config_for(mooncake_pool))
    yield opened
    opened.close()


def test_a_loads_verification_runs_at_the_loads_priority_after_a_store_started_the_helpers(
    adapter: BackendAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Core runs stores on write-back threads (nice 10) and loads at the process's
    priority; a helper thread keeps the priority of the thread that started it.  Helpers
    one store started ran loads' verification at nice 10, behind every busier thread of
    the machine."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: checksums are never split between threads")
    client = BlockingAdapterClient(adapter)
    keys = make_keys(8)
    size = PARALLEL_MIN_BYTES // 4  # a batch of twice PARALLEL_MIN_BYTES: split between threads
    data = [pattern(index, size) for index in range(len(keys))]
    # The store comes first, on core's write-back threads: their nice value is raised.
    assert client.store(keys, [memoryview(d) for d in data]) == [True] * len(keys)

    verified_at: dict[str, int] = {}  # thread name -> its nice value
    real_verify = backend_module.verify_payload

    def noting_verify(header: Any, payload: memoryview) -> None:
        verified_at[threading.current_thread().name] = _nice()
        real_verify(header, payload)

    monkeypatch.setattr(backend_module, "verify_payload", noting_verify)
    assert client.lookup_and_lock(keys).found == [True] * len(keys)
    buffers = [memoryview(bytearray(size)) for _ in keys]
    assert client.load(keys, buffers) == [True] * len(keys)
    adapter.unlock(keys)
    assert [bytes(b) for b in buffers] == data
    assert len(verified_at) >= 2, f"the load was verified on one thread only: {verified_at}"
    assert set(verified_at.values()) == {_nice()}, (
        f"a load was verified at another priority than the process's ({_nice()}): {verified_at}"
    )
