"""A LOOKUP (or the prefetch it started) answered with a hit count that is no prefix of the
keys asked -- more hits than keys, or fewer than none -- is a protocol error: the count is
not handed to the caller, who would retrieve that many objects or take the keys past the
prefix as cached, and the locks the server may have taken on the keys are given back.  Such
a count used to be returned as it came.

No real server answers so; a ROUTER socket in the test speaks the wire format instead."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from lmcache_tiers.client import Client, ProtocolError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.threads import joined
from lmcache_tiers.wire import protocol as p

_HANDLE = 7


class _MiscountingPeer:
    """Answers HELLO (no segment), LOOKUP with ``hits(len(keys))`` -- or, with
    ``prefetch``, with a handle whose WAIT and QUERY give that count -- and RELEASE,
    noting the keys released."""

    def __init__(self, hits: Callable[[int], int], prefetch: bool) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port: int = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.released: list[ObjectKey] = []
        self._hits = hits
        self._prefetch = prefetch
        self._asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="miscounting-peer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(50):
                continue
            identity, header, *_ = self.socket.recv_multipart()
            request = p.request_decoder.decode(header)
            reply: Any
            if isinstance(request, p.Hello):
                reply = p.HelloReply(request.req_id, features=list(p.FEATURES))
            elif isinstance(request, p.Lookup):
                self._asked = len(request.keys)
                if self._prefetch:
                    reply = p.LookupReply(request.req_id, handle=_HANDLE)
                else:
                    reply = p.LookupReply(request.req_id, hits=self._hits(self._asked))
            elif isinstance(request, (p.WaitPrefetchStatus, p.QueryPrefetchStatus)):
                reply = p.PrefetchStatusReply(request.req_id, hits=self._hits(self._asked))
            elif isinstance(request, p.Release):
                self.released.extend(request.keys)
                reply = p.ReleaseReply(request.req_id, released=len(request.keys))
            else:
                reply = p.PingReply(request.req_id)
            self.socket.send_multipart([identity, p.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        joined(self._thread, "the fake peer")
        self.socket.close(0)


_COUNTS: dict[str, Callable[[int], int]] = {
    "more_than_keys": lambda asked: asked + 1,
    "negative": lambda _: -1,
}


@pytest.fixture(params=sorted(_COUNTS))
def count(request: pytest.FixtureRequest) -> Callable[[int], int]:
    return _COUNTS[request.param]


@pytest.fixture(params=[False, True], ids=["at_once", "after_prefetch"])
def peer(request: pytest.FixtureRequest, count: Callable[[int], int]) -> Iterator[_MiscountingPeer]:
    serving = _MiscountingPeer(count, prefetch=request.param)
    yield serving
    serving.close()


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
    peer: _MiscountingPeer, call: Callable[[Client, list[ObjectKey]], object]
) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(3)]
    with Client(peer.url, timeout=5.0) as client:
        with pytest.raises(ProtocolError, match="hits for 3 keys"):
            answer = call(client, keys)
            pytest.fail(f"{answer!r} handed out as the hit count of {len(keys)} keys")
        assert peer.released == keys
