"""A STORE_RESERVE that raises after L1 reserved and fenced its keys -- while its
reservations are handed to the client's session, or its reply is built -- answers the
client with the error and never tells it their slots: nobody copies into them, commits
or aborts them.  They are given back at once, counted with the request's failure and
logged.  They stayed reserved until the write TTL, then fenced until the server stopped
(nothing of the client's could name them), and the client's own later stores of those
keys skipped them as being written.  The step that raises is made to by the test."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
from lmcache_plugin_frontend_native.sessions import Session
from native_keys import keys_of, stats_of

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.server.app import TiersServer

CHUNK = 4096


def _raising_at(step: str, server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next STORE_RESERVE raises at ``step``, after L1 reserved and fenced its keys."""
    handlers = server.frontends[0].handlers

    def fail(*args: Any) -> None:
        monkeypatch.undo()
        raise MemoryError(f"made to fail at {step}")

    if step == "writer_note":
        monkeypatch.setattr(handlers, "_note_writer", fail)
    elif step == "session":
        add_writes = Session.add_writes

        def added_then_failed(session: Session, *args: Any) -> None:
            add_writes(session, *args)  # the session holds them when it raises
            fail()

        monkeypatch.setattr(Session, "add_writes", added_then_failed)
    else:
        monkeypatch.setattr(handlers, "_reserve_reply", fail)


@pytest.mark.parametrize("step", ["writer_note", "session", "reply"])
def test_reservations_of_a_store_reserve_that_raised_are_given_back(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, step: str
) -> None:
    caplog.set_level(logging.WARNING, logger="lmcache_plugin_frontend_native")
    keys = keys_of(2)
    data = [os.urandom(CHUNK) for _ in keys]
    l1 = server.storage.l1
    with Client(server.endpoint, timeout=30) as client:
        assert client.uses_shm
        _raising_at(step, server, monkeypatch)
        with pytest.raises(ServerError, match="INTERNAL"):
            client.store(keys, data)
        stats = l1.stats()
        assert (stats.write_locked, stats.objects, stats.used_bytes) == (0, 0, 0)
        leases = l1.lease_stats()
        assert (leases.fenced_extents, leases.fenced_bytes) == (0, 0)
        for session in server.frontends[0].handlers.sessions:
            assert not (session.writes or session.fenced)
        counted = stats_of(server)
        assert counted.failures["internal"] == 1
        assert counted.store_keys_refused["internal"] == len(keys)
        given_back = [record.getMessage() for record in caplog.records if "given back" in record.getMessage()]
        assert len(given_back) == 1 and "2 reservations" in given_back[0]
        # The keys are free for the client's next store.
        assert client.store(keys, data) == len(keys)
        targets = [bytearray(CHUNK) for _ in keys]
        assert client.retrieve_into(keys, targets) == len(keys)
        assert [bytes(target) for target in targets] == data
