"""The client keeps the header of the last LOOKUP encoded but for its request id, and
encodes only the id for the next LOOKUP of the same keys with the same wait (an engine asks
about one prompt at every scheduler step).  The bytes sent are those encoding the request
gives, whatever the id's width; another key list, another wait, a list the caller changed
after the call, or a refusal makes a new header."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_tiers.client import Client, connection
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

# ids about each width msgpack gives an unsigned integer (1, 2, 3, 5 and 9 bytes)
_IDS = [1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**62]


def _keys(count: int) -> list[ObjectKey]:
    return [ObjectKey("unit", 0, os.urandom(8)) for _ in range(count)]


@pytest.fixture
def client(server: TiersServer) -> Iterator[Client]:
    with Client(server.endpoint, timeout=10.0) as client:
        yield client


def _header(client: Client, request: p.Lookup, req_id: int) -> bytes:
    client._ids = itertools.count(req_id)
    return client._header(request)


def test_the_header_kept_is_the_encoding_of_the_request_at_every_id_width(client: Client) -> None:
    keys = _keys(16)
    for req_id in _IDS:
        request = p.Lookup(0, "", keys, 10.0)
        assert _header(client, request, req_id) == p.encode(request)
        assert request.req_id == req_id and request.keys is keys


def test_another_key_list_or_wait_makes_a_new_header(client: Client) -> None:
    keys, others = _keys(4), _keys(4)
    _header(client, p.Lookup(0, "", keys, 10.0), 1)
    for request in (
        p.Lookup(0, "", others, 10.0),
        p.Lookup(0, "", keys, 2.5),
        p.Lookup(0, "", keys[:3], 10.0),
    ):
        assert _header(client, request, 70_000) == p.encode(request)


def test_a_key_list_changed_after_the_call_is_encoded_as_it_is_now(client: Client) -> None:
    keys = _keys(4)
    _header(client, p.Lookup(0, "", keys, 10.0), 1)
    keys[2] = ObjectKey("unit", 0, os.urandom(8))
    request = p.Lookup(0, "", keys, 10.0)
    assert _header(client, request, 2) == p.encode(request)


def test_a_repeated_lookup_encodes_only_its_id(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys(16)
    client.store(keys, [np.full(64, index, dtype=np.uint8) for index in range(16)])
    assert client.lookup(keys) == 16
    encoded: list[object] = []

    def counted(message: object) -> bytes:
        encoded.append(message)
        return p.encoder.encode(message)

    monkeypatch.setattr(connection.p, "encode", counted)
    for _ in range(3):
        assert client.lookup(keys) == 16
    assert not [message for message in encoded if isinstance(message, p.Lookup)]
    client.release(keys)


def test_lookups_are_answered_across_id_widths(client: Client) -> None:
    """The server reads every id width the kept header is given, and the replies are
    matched to them."""
    keys = _keys(8)
    client.store(keys, [np.full(64, index, dtype=np.uint8) for index in range(8)])
    for req_id in _IDS:
        client._ids = itertools.count(req_id)
        assert client.lookup(keys) == 8
        assert client.lookup(keys[:5]) == 5
        client.release(keys)
