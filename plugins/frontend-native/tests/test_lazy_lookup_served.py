"""A served LOOKUP of a new prompt leaves its keys undecoded (``LazyKeys``) only where a miss
at the first key needs no other: without L2 adapters, or with adapters that all answer
lookups at once (asked about that key alone first).  An adapter answering only on its
worker is asked about every key of a lookup that misses in L1, so proving the list valid
as a whole would only be paid for on top.  Keys the front end never decoded that only L2
holds are found by such a lookup all the same (the first question is a hit)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.lazy_keys import LazyKeys
from lmcache_tiers.server.app import TiersServer

Factory = Callable[..., TiersServer]
MOCK = '{"type": "mock", "max_size_gb": 0.1}'  # answers lookups at once (from memory)
#: the same behind fault_inject (no faults), which answers lookups on its worker only
WORKER_ONLY = '{"type": "fault_inject", "rate": 0.0, "inner": {"type": "mock", "max_size_gb": 0.1}}'
#: one that has contains_many_now but says it never answers with it (a simulated latency)
SLOW = '{"type": "mock", "max_size_gb": 0.1, "latency_s": 0.001, "namespace": "slow"}'
COUNT = 64  # past the decoder's threshold for undecoded lists
SIZE = 4096


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
    [([], LazyKeys), ([MOCK], LazyKeys), ([MOCK, WORKER_ONLY], list), ([MOCK, SLOW], list)],
    ids=[
        "l1-only",
        "answering-at-once",
        "one-answering-on-its-worker",
        "one-saying-it-never-answers-at-once",
    ],
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


def stored_behind_the_front_end(
    server: TiersServer, keys: list[ObjectKey], *, keep_in_l1: int
) -> list[bytes]:
    """``keys`` stored through the storage itself (the front end never decodes them), in L2,
    with only the first ``keep_in_l1`` left in L1; their bytes."""
    storage = server.storage
    data = [os.urandom(SIZE) for _ in keys]
    reserved = storage.reserve_write(keys, [SIZE] * len(keys))
    for key, chunk in zip(keys, data, strict=True):
        storage.view(reserved[key])[:] = chunk
    storage.commit_write(keys)
    assert storage.flush(10)
    storage.clear()
    if keep_in_l1:
        head = keys[:keep_in_l1]
        reserved = storage.reserve_write(head, [SIZE] * len(head))
        for key, chunk in zip(head, data[:keep_in_l1], strict=True):
            storage.view(reserved[key])[:] = chunk
        storage.commit_write(head, to_l2=False)
    return data


@pytest.mark.parametrize("kind", ["mock", "fs"])
@pytest.mark.parametrize(("in_l2", "in_l1"), [(COUNT, 0), (COUNT, 10), (COUNT // 2, 0)])
def test_keys_only_l2_holds_are_found_by_an_undecoded_lookup(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str, in_l2: int, in_l1: int
) -> None:
    adapter = (
        {"type": "mock", "max_size_gb": 0.1} if kind == "mock" else {"type": "fs", "path": str(tmp_path)}
    )
    server = make_server(adapters=[json.dumps(adapter)])
    prompt = keys_of(COUNT)
    data = stored_behind_the_front_end(server, prompt[:in_l2], keep_in_l1=in_l1)
    seen = lookups_seen(server, monkeypatch)
    with Client(server.endpoint) as client:
        assert client.lookup(prompt) == in_l2
        with client.retrieve(prompt) as views:
            assert [bytes(view) for view in views] == data
    assert seen[0] is LazyKeys
