"""The threads an adapter starts are named for it: a thread dump (py-spy, faulthandler)
of a server with several adapters must say whose each thread is."""

from __future__ import annotations

import threading

import pytest
from l2_backends import AsyncDictBackend, DictBackend, Zlib, open_dict

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

PAYLOAD = b"kv-cache " * 2000


@pytest.mark.parametrize("backend", [DictBackend, AsyncDictBackend])
def test_every_thread_of_an_adapter_carries_its_name(
    backend: type[DictBackend], adapters: list[BackendAdapter]
) -> None:
    """A serde that changes the bytes makes a coroutine backend's stores encode, and its
    loads decode, off the adapter's event loop: on threads named for the adapter too."""
    before = set(threading.enumerate())
    adapter = open_dict(backend, serde=[Zlib()])
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    keys = make_keys(1)
    assert client.store(keys, [memoryview(PAYLOAD)]) == [True]
    assert client.lookup_and_lock(keys).found == [True]
    buffer = memoryview(bytearray(len(PAYLOAD)))
    assert client.load(keys, [buffer]) == [True]
    started = sorted(thread.name for thread in threading.enumerate() if thread not in before)
    assert started, "the adapter started no thread"
    assert [name for name in started if not name.startswith("l2-0:t-")] == [], started
