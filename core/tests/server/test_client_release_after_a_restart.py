"""``release`` after the connection dropped: the server keeps a client's locks per
connection, so the locks taken over the dropped one (by a server that may have restarted
since) are out of reach of any request over the next.  A release of keys whose locks were
all taken before the drop sends nothing (it logs that they expire with the lock TTL); it
went out by key to whatever server listened at the address then, by the key limit of the
server greeted before -- refused as TOO_LARGE by a restarted server with a lower one, or
waited for until its timeout while no server was back yet.  Locks taken over the new
connection are released as before."""

from __future__ import annotations

import logging

import pytest
from client_restarts import Factory, fresh_keys, native, restarted, stats_of, stored_by_another_client

from lmcache_tiers.client import Client
from lmcache_tiers.testing.client_restarts import stopped


def test_a_release_of_locks_taken_before_a_restart_sends_nothing_to_the_restarted_server(
    make_server: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_server(frontends=native(4))
    keys = fresh_keys(4)
    stored_by_another_client(first, keys)
    with Client(first.endpoint, timeout=30) as client:
        assert client.lookup(keys) == len(keys)
        second = restarted(make_server, first, client, max_keys=2)
        with caplog.at_level(logging.INFO, logger="lmcache_tiers.client"):
            assert client.release(keys) == 0
        assert "the locks it held on 4 keys are not released over the next connection" in caplog.text
    assert stats_of(second).requests["Release"] == 0
    assert stats_of(second).failures["too_large"] == 0


def test_a_release_of_locks_whose_server_is_gone_waits_for_no_server(make_server: Factory) -> None:
    server = make_server()
    keys = fresh_keys(2)
    stored_by_another_client(server, keys)
    with Client(server.endpoint, timeout=1.0) as client:
        assert client.lookup(keys) == len(keys)
        stopped(server, client)
        # Nobody listens at the address: a RELEASE would wait for a server until the timeout.
        assert client.release(keys) == 0


def test_locks_taken_after_a_restart_are_released_and_those_taken_before_are_not(
    make_server: Factory,
) -> None:
    first = make_server(frontends=native(4))
    before = fresh_keys(4)
    after = fresh_keys(2)
    stored_by_another_client(first, before)
    with Client(first.endpoint, timeout=30) as client:
        assert client.lookup(before) == len(before)
        second = restarted(make_server, first, client, max_keys=2)
        stored_by_another_client(second, [*before, *after])
        assert client.lookup(after) == len(after)
        assert stats_of(second).locked_keys == len(after)
        # One request, by the restarted server's limit: the keys locked over the new connection.
        assert client.release([*before, *after]) == len(after)
        assert stats_of(second).requests["Release"] == 1
        assert stats_of(second).locked_keys == 0
        # A key locked before the restart and again after it is released.
        assert client.lookup(before[:2]) == 2
        assert client.release(before[:2]) == 2
    assert stats_of(second).failures["too_large"] == 0
