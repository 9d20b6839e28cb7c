"""A served LOOKUP of a new prompt leaves its keys undecoded (``LazyKeys``) only where a miss
at the first key needs no other: without L2 adapters, or with adapters that all answer
lookups at once (asked about that key alone first).  An adapter answering only on its
worker is asked about every key of a lookup that misses in L1, so proving the list valid
as a whole would only be paid for on top."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.lazy_keys import LazyKeys
from lmcache_tiers.server.app import TiersServer

Factory = Callable[..., TiersServer]
MOCK = '{"type": "mock", "max_size_gb": 0.1}'  # answers lookups at once (from memory)
#: the same behind fault_inject (no faults), which answers lookups on its worker only
WORKER_ONLY = '{"type": "fault_inject", "rate": 0.0, "inner": {"type": "mock", "max_size_gb": 0.1}}'
COUNT = 64  # past the decoder's threshold for undecoded lists


def lookups_seen(server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> list[type]:
    """The type of the key list of every lookup the front end hands the storage from now on."""
    seen: list[type] = []
    start = server.storage.start_prefetch

    def spy(keys: Any, **options: Any) -> Any:
        seen.append(type(keys))
        return start(keys, **options)

    monkeypatch.setattr(server.storage, "start_prefetch", spy)
    return seen


@pytest.mark.parametrize(
    ("adapters", "kind"),
    [([], LazyKeys), ([MOCK], LazyKeys), ([MOCK, WORKER_ONLY], list)],
    ids=["l1-only", "answering-at-once", "one-answering-on-its-worker"],
)
def test_a_new_prompt_is_decoded_only_when_an_l2_will_ask_for_every_key(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, adapters: list[str], kind: type
) -> None:
    server = make_server(adapters=adapters)
    assert len(server.storage.adapters) == len(adapters)
    seen = lookups_seen(server, monkeypatch)
    with Client(server.endpoint) as client:
        assert client.lookup(keys_of(COUNT)) == 0
        stored, data = keys_of(COUNT), [os.urandom(4096) for _ in range(COUNT)]
        assert client.store(stored, data) == COUNT
        assert client.lookup(stored) == COUNT
        with client.retrieve(stored) as views:
            assert [bytes(view) for view in views] == data
    assert seen == [kind, list], "a prompt whose first key the decoder knows is a list anyway"
