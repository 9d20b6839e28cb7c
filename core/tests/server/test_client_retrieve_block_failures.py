"""An exception raised inside a ``retrieve`` block is the caller's, not necessarily this
client's: a ConnectionLostError from another client (another server's) says nothing of
this client's connection, whose locks are released on the way out as after any other
exception.  They used to be left to the server's lock TTL, as if this client's own
connection had dropped, pinning the objects in L1 meanwhile."""

from __future__ import annotations

import os

import pytest

from lmcache_tiers.client import Client, ConnectionLostError, RequestTimeoutError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer


def _locked_keys(client: Client) -> int:
    locked: int = client.status()["server"]["locked_keys"]
    return locked


@pytest.mark.parametrize("failure", [ConnectionLostError, RequestTimeoutError, RuntimeError])
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
def test_the_locks_of_a_retrieve_block_left_by_an_exception_of_the_caller_are_released(
    server: TiersServer, failure: type[Exception], shm: bool
) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(3)]
    with Client(server.endpoint, shm=shm) as client:
        assert client.store(keys, [b"x" * 64] * len(keys)) == len(keys)
        assert client.lookup(keys) == len(keys)
        with pytest.raises(failure, match="another server's"), client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == [b"x" * 64] * len(keys)
            raise failure("another server's call, made inside the block")
        client.ping()  # a release sent without waiting for its reply has been handled
        assert _locked_keys(client) == 0
