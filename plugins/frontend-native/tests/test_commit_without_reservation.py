"""A STORE_COMMIT naming keys its client holds no reservation of stores nothing: the keys
are counted as refused (``reservation_lost``) and the refusal is explained in the log."""

from __future__ import annotations

import logging

import pytest
from native_clients import OtherProcessClient
from native_keys import keys_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

LOGGER = "lmcache_plugin_frontend_native"


def lost_commit_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.WARNING and "reservation_lost" in record.getMessage()
    ]


def test_a_commit_of_keys_never_reserved_is_counted_and_logged(
    server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_of(2)
    with caplog.at_level(logging.WARNING, logger=LOGGER), Client(server.endpoint) as client:
        assert client._call(p.StoreCommit(0, "", keys), p.StoreReply).done == [False, False]
    assert stats_of(server).store_keys_refused["reservation_lost"] == 2
    lines = lost_commit_lines(caplog)
    assert len(lines) == 1 and "2 keys" in lines[0], lines


def test_a_commit_of_another_clients_reservation_is_counted_and_logged(
    server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_of(1)
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        Client(server.endpoint) as owner,
        OtherProcessClient(server.endpoint) as stranger,
    ):
        (slot,) = owner._call(p.StoreReserve(0, "", keys, [100]), p.StoreReserveReply).slots
        assert slot.offset >= 0
        assert stranger._call(p.StoreCommit(0, "", keys), p.StoreReply).done == [False]
        assert owner._call(p.StoreCommit(0, "", keys), p.StoreReply).done == [True]
    assert stats_of(server).store_keys_refused["reservation_lost"] == 1
    assert len(lost_commit_lines(caplog)) == 1
