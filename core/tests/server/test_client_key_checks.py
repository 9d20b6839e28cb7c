"""Keys that are not ObjectKeys are refused by the client with one TypeError, before
anything is sent.  They used to go out as they were: the server answered MALFORMED
(counted among its failures, as if a client were broken or hostile), and a store or
lookup longer than one request had already stored, or locked, the parts before the bad
key when the refusal came.  So are prefetch handles that cannot be handles (a string, a
bool, a negative number), which the server refused as malformed too."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer

CHUNK = b"k" * 64


def _keys(count: int) -> list[ObjectKey]:
    return [ObjectKey("unit", 0, os.urandom(8)) for _ in range(count)]


def _requests_and_failures(client: Client) -> tuple[dict[str, int], dict[str, int]]:
    server = client.status()["server"]
    requests = {name: count for name, count in server["requests"].items() if name != "Status"}
    return requests, server["failures"]


def calls(keys: list[Any]) -> dict[str, Callable[[Client], Any]]:
    """Every call that takes keys, given ``keys``."""

    def retrieve(client: Client) -> None:
        with client.retrieve(keys):
            pass

    return {
        "store": lambda client: client.store(keys, [CHUNK] * len(keys)),
        "lookup": lambda client: client.lookup(keys),
        "lookup_many": lambda client: client.lookup_many([_keys(1), keys]),
        "start_lookup": lambda client: client.start_lookup(keys),
        "retrieve": retrieve,
        "retrieve_into": lambda client: client.retrieve_into(keys, [bytearray(len(CHUNK))] * len(keys)),
        "release": lambda client: client.release(keys),
        "evict": lambda client: client.evict(keys),
    }


BAD_KEYS: dict[str, list[Any]] = {
    "str": ["model@0@abc"],
    "bytes": [b"\x01" * 32],
    "none": [None],
    "tuple": [("unit", 0, b"\x01" * 8, 0, "")],
}


@pytest.mark.parametrize("bad", sorted(BAD_KEYS))
@pytest.mark.parametrize("call", sorted(calls([])))
def test_a_call_given_something_else_than_keys_refuses_it_before_sending(
    server: TiersServer, call: str, bad: str
) -> None:
    with Client(server.endpoint) as client:
        keys = [*_keys(2), *BAD_KEYS[bad]]
        before = _requests_and_failures(client)
        with pytest.raises(TypeError, match=r"keys\[2\] is a .*, not an ObjectKey"):
            calls(keys)[call](client)
        assert _requests_and_failures(client) == before


def test_a_string_given_as_the_key_list_is_refused_as_a_whole(server: TiersServer) -> None:
    refusal = "keys must be a sequence of ObjectKeys, not a str"
    with Client(server.endpoint) as client, pytest.raises(TypeError, match=refusal):
        client.lookup("model@0@abc")  # type: ignore[arg-type]


def test_a_store_longer_than_one_request_stores_nothing_when_a_later_key_is_bad(server: TiersServer) -> None:
    with Client(server.endpoint) as client:
        good = _keys(client.max_keys + 1)
        with pytest.raises(TypeError, match=rf"keys\[{len(good)}\]"):
            client.store([*good, "not a key"], [CHUNK] * (len(good) + 1))  # type: ignore[list-item]
        assert client.lookup(good) == 0
        assert _requests_and_failures(client)[1].get("malformed", 0) == 0


@pytest.mark.parametrize(
    ("handle", "refusal"),
    [("7", TypeError), (True, TypeError), (1.0, TypeError), (-1, ValueError), (1 << 63, ValueError)],
    ids=repr,
)
@pytest.mark.parametrize("call", ["query_prefetch", "wait_prefetch"])
def test_a_prefetch_call_refuses_what_cannot_be_a_handle_before_sending(
    server: TiersServer, call: str, handle: Any, refusal: type[Exception]
) -> None:
    with Client(server.endpoint) as client:
        before = _requests_and_failures(client)
        with pytest.raises(refusal, match="prefetch handle"):
            if call == "query_prefetch":
                client.query_prefetch(handle)
            else:
                client.wait_prefetch(handle, 0.1)
        assert _requests_and_failures(client) == before
