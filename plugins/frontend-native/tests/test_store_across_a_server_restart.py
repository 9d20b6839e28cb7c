"""A shared-memory store whose server restarted at its address while it copied into its
reservations: its bytes went into the old server's segment, and its reservations went
with that server.  Its commit (or abort) must not reach the restarted server, where the
client may hold reservations of the same keys again (another thread storing them) whose
bytes are not copied yet: committing those would hand readers bytes nobody wrote."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from native_keys import keys_of
from native_restarts import copied_and_committed_by_that_thread, reserved_by_another_thread

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import restarted_at
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]

CHUNK = 4096


@pytest.mark.parametrize("fails", [False, True], ids=["commit", "abort"])
def test_a_store_whose_server_restarted_under_its_copy_touches_no_reservation_there(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    port = free_port()
    first = make_server(port=port)
    keys = keys_of(2)
    buffers = [np.full(CHUNK, index + 1, dtype=np.uint8) for index in range(len(keys))]
    with Client(first.endpoint, timeout=30) as client:
        segment = client._segment
        assert segment is not None
        write_many = segment.write_many
        theirs: list[list[p.Slot]] = []

        def write_then_restart(copies: Any) -> None:
            """The store's copy; meanwhile the server restarts, and another thread of the
            client greets it and reserves the same keys (its copy still to come)."""
            write_many(copies)
            restarted_at(port, first, client, make_server)
            theirs.append(reserved_by_another_thread(client, keys, CHUNK))
            if fails:
                raise KeyboardInterrupt  # the store is cut short after its copy

        monkeypatch.setattr(segment, "write_many", write_then_restart)
        if fails:
            with pytest.raises(KeyboardInterrupt):
                client.store(keys, buffers)
        else:
            client.store(keys, buffers)
        assert theirs
        assert client._segment is not segment
        # The other thread's reservations are still its own: it copies and commits them.
        copied_and_committed_by_that_thread(client, theirs[0], keys, buffers)


def test_no_other_thread_can_greet_a_server_between_a_stores_look_at_it_and_its_commit(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else another thread could greet a server restarted meanwhile and reserve the same
    keys there before the commit reaches it."""
    keys = keys_of(2)
    with Client(server.endpoint, timeout=30) as client:
        call = client._call
        free: list[bool] = []

        def commit_when_looked_at(request: p._Request, *args: Any, **kwargs: Any) -> Any:
            if isinstance(request, p.StoreCommit):

                def another_thread() -> None:
                    free.append(client._lock.acquire(blocking=False))
                    if free[-1]:
                        client._lock.release()

                thread = threading.Thread(target=another_thread)
                thread.start()
                thread.join(30)
            return call(request, *args, **kwargs)

        monkeypatch.setattr(client, "_call", commit_when_looked_at)
        assert client.store(keys, [np.zeros(CHUNK, dtype=np.uint8)] * len(keys)) == 2
        assert free == [False]
