"""A signal handler's exception (Ctrl-C) that comes right after the client greeted a
server restarted at its address, before it mapped that server's segment, leaves the
client greeting it again before its next request that names arena offsets: trusting the
old mapping, a store would copy into the old server's segment and commit, on the new
one, extents nobody wrote."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from native_keys import keys_of
from native_restarts import assert_stored_there

from lmcache_tiers.client import Client, api
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.testing.server import until_reachable
from lmcache_tiers.wire import protocol as p

CHUNK = 4096


def test_a_store_after_a_greeting_cut_short_goes_to_the_restarted_servers_segment(
    make_server: Callable[..., TiersServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    first = make_server(port=port)
    keys = keys_of(2)
    buffers = [np.full(CHUNK, index + 3, dtype=np.uint8) for index in range(len(keys))]
    with Client(first.endpoint, timeout=30) as client:
        first.request_stop()
        assert first.frontends[0].join(30)
        second = make_server(port=port)
        until_reachable(client)
        greeted: list[p.HelloReply] = []
        greet = client._greet
        compared = api._segment_identity

        def greeting(*args: Any) -> p.HelloReply:
            greeted.append(greet(*args))
            return greeted[-1]

        def interrupted(hello: p.HelloReply) -> Any:
            if greeted:
                monkeypatch.undo()
                raise KeyboardInterrupt  # right after the HELLO was answered
            return compared(hello)

        monkeypatch.setattr(client, "_greet", greeting)
        monkeypatch.setattr(api, "_segment_identity", interrupted)
        with pytest.raises(KeyboardInterrupt):
            client.store(keys, buffers)
        assert greeted and greeted[0].shm_name == second.storage.l1.arena.name
        assert client.store(keys, buffers) == 2
        assert_stored_there(second.endpoint, keys, buffers)
