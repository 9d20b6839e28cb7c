"""A STORE_COMMIT or STORE_INLINE reply carries one flag per key sent, in order (stored or
not).  A reply with another count of flags cannot be matched to the keys: it is a protocol
error, and nothing of it is counted as stored.  The flags were summed as they came, so a
reply with a flag more than the keys sent counted a key stored that was never sent, and
one with a flag fewer passed for a store the server half refused.

No real server answers so: the native front end's reply is altered on its way out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from native_keys import keys_of

from lmcache_tiers.client import Client, ProtocolError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]

CHUNK = 4096


def _altered(answer: Callable[..., Any], change: int) -> Callable[..., Any]:
    """``answer``, a handler building a StoreReply, with ``change`` flags more than it
    gives (fewer when negative)."""

    def altered(*args: Any) -> Any:
        reply, payloads = answer(*args)
        done = reply.done + [True] * change if change > 0 else reply.done[:change]
        return p.StoreReply(reply.req_id, done=done), payloads

    return altered


def _answered_with_flags(
    server: TiersServer, shm: bool, change: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The front end handles STORE_COMMIT (``shm``) or STORE_INLINE as ever, and answers
    with ``change`` flags more than it should (fewer when negative)."""
    handlers = server.frontends[0].handlers
    if shm:
        monkeypatch.setitem(handlers._table, p.StoreCommit, _altered(handlers._table[p.StoreCommit], change))
    else:  # built on the loop thread once the pool's copy is over
        monkeypatch.setattr(handlers, "_count_inline", _altered(handlers._count_inline, change))


@pytest.mark.parametrize("change", [1, -1], ids=["a flag more", "a flag fewer"])
@pytest.mark.parametrize("shm", [True, False], ids=["commit", "inline"])
def test_a_store_reply_with_another_count_of_flags_than_keys_is_a_protocol_error(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, shm: bool, change: int
) -> None:
    server = make_server()
    keys = keys_of(2)
    buffers = [np.full(CHUNK, index + 1, dtype=np.uint8) for index in range(len(keys))]
    with Client(server.endpoint, timeout=30, shm=shm) as client:
        assert client.uses_shm == shm
        _answered_with_flags(server, shm, change, monkeypatch)
        answered = len(keys) + change
        request = "STORE_COMMIT" if shm else "STORE_INLINE"
        with pytest.raises(ProtocolError, match=f"{request} answered {answered} flags for {len(keys)} keys"):
            client.store(keys, buffers)
        monkeypatch.undo()
        # The client goes on: the keys the server did store are skipped as present.
        assert client.store(keys, buffers) == 0
        targets = [np.zeros_like(buffer) for buffer in buffers]
        assert client.retrieve_into(keys, targets) == len(keys)
        for target, buffer in zip(targets, buffers, strict=True):
            assert np.array_equal(target, buffer)
