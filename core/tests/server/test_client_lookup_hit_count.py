"""A LOOKUP (or the prefetch it started) answered with a hit count that is no prefix of the
keys asked -- more hits than keys, or fewer than none -- is a protocol error: the count is
not handed to the caller, who would retrieve that many objects or take the keys past the
prefix as cached, and the locks the server may have taken on the keys are given back.  Such
a count used to be returned as it came.

No real server answers so; a fake peer (``lmcache_tiers.testing.fake_peer``) does."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmcache_tiers.client import Client, ProtocolError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.fake_peer import FakePeer, PeerAnswer, PeerReply
from lmcache_tiers.wire import protocol as p

_HANDLE = 7


def _miscounting(hits: Callable[[int], int], prefetch: bool) -> PeerAnswer:
    """Answers LOOKUP with ``hits(len(keys))`` -- or, with ``prefetch``, with a handle
    whose WAIT and QUERY give that count."""
    asked = 0

    def answer(request: Any) -> PeerReply | None:
        nonlocal asked
        if isinstance(request, p.Lookup):
            asked = len(request.keys)
            if prefetch:
                return p.LookupReply(request.req_id, handle=_HANDLE), ()
            return p.LookupReply(request.req_id, hits=hits(asked)), ()
        if isinstance(request, (p.WaitPrefetchStatus, p.QueryPrefetchStatus)):
            return p.PrefetchStatusReply(request.req_id, hits=hits(asked)), ()
        return None

    return answer


_COUNTS: dict[str, Callable[[int], int]] = {
    "more_than_keys": lambda asked: asked + 1,
    "negative": lambda _: -1,
}


@pytest.fixture(params=sorted(_COUNTS))
def count(request: pytest.FixtureRequest) -> Callable[[int], int]:
    return _COUNTS[request.param]


@pytest.fixture(params=[False, True], ids=["at_once", "after_prefetch"])
def peer(request: pytest.FixtureRequest, count: Callable[[int], int]) -> Iterator[FakePeer]:
    with FakePeer(_miscounting(count, prefetch=request.param), name="miscounting-peer") as serving:
        yield serving


def _lookup(client: Client, keys: list[ObjectKey]) -> object:
    return client.lookup(keys)


def _lookup_many(client: Client, keys: list[ObjectKey]) -> object:
    return client.lookup_many([keys])


def _start_and_wait(client: Client, keys: list[ObjectKey]) -> object:
    handle, hits = client.start_lookup(keys)
    return hits if hits is not None else client.wait_prefetch(handle, 5.0)


def _start_and_query(client: Client, keys: list[ObjectKey]) -> object:
    handle, hits = client.start_lookup(keys)
    return hits if hits is not None else client.query_prefetch(handle)


@pytest.mark.parametrize("call", [_lookup, _lookup_many, _start_and_wait, _start_and_query])
def test_a_hit_count_that_is_no_prefix_of_the_keys_is_a_protocol_error(
    peer: FakePeer, call: Callable[[Client, list[ObjectKey]], object]
) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(3)]
    with Client(peer.url, timeout=5.0) as client:
        with pytest.raises(ProtocolError, match="hits for 3 keys"):
            answer = call(client, keys)
            pytest.fail(f"{answer!r} handed out as the hit count of {len(keys)} keys")
        assert peer.released == keys
