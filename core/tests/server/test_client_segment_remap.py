"""A server restarted at the client's address offers another segment; when mapping it
fails with an OS error (no address space or map count left, say), not because it is
another host's or user's, the client sends bytes inline from then on and says so once.
The error used to escape the one call that followed the server, and every later call
went inline without a word."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import NoReturn

import pytest

from lmcache_tiers.client import Client, api
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import until_reachable


def _no_address_space(*args: object, **kwargs: object) -> NoReturn:
    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))


def test_a_restarted_servers_segment_that_cannot_be_mapped_is_said_once_and_bytes_go_inline(
    make_server: Callable[..., TiersServer],
    restart_at_the_same_port: Callable[[TiersServer], TiersServer],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = make_server()
    client = Client(first.endpoint, timeout=5.0)
    try:
        assert client.uses_shm
        restart_at_the_same_port(first)
        monkeypatch.setattr(api, "MappedSegment", _no_address_space)
        until_reachable(client)
        keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(3)]
        payloads = [bytes([index + 1]) * 4096 for index in range(len(keys))]
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers.client"):
            assert client.store(keys[:2], payloads[:2]) == 2
            assert not client.uses_shm
            assert client.store(keys[2:], payloads[2:]) == 1
            with client.retrieve(keys) as views:
                assert [bytes(view) for view in views] == payloads
        said = [line for line in caplog.messages if "could not be mapped" in line]
        assert len(said) == 1, said
        assert os.strerror(errno.ENOMEM) in said[0] and "bytes travel inline" in said[0]
    finally:
        client.close()
