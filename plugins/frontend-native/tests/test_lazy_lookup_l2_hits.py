"""A served LOOKUP whose keys the front end has never decoded (``LazyKeys``) but an L2
adapter holds -- stored before a restart, or by another path -- finds them there: the
first question past L1's prefix is a hit, the whole lookup goes on, and the bytes
retrieved are the bytes stored.  With an L1 prefix too, and where L2 holds only the
first part of the prompt."""

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
COUNT = 64  # past the decoder's threshold for undecoded lists
SIZE = 4096


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
    seen: list[type] = []
    start = server.storage.start_prefetch

    def spy(keys: Any, **options: Any) -> Any:
        seen.append(type(keys))
        return start(keys, **options)

    monkeypatch.setattr(server.storage, "start_prefetch", spy)
    with Client(server.endpoint) as client:
        assert client.lookup(prompt) == in_l2
        with client.retrieve(prompt) as views:
            assert [bytes(view) for view in views] == data
    assert seen[0] is LazyKeys
