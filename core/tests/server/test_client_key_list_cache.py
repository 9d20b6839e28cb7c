"""The client keeps the msgpack of the last key list it sent and reuses it for a list equal
to it.  Keys equal by value may still encode differently: a rank of ``True`` or ``1.0``
equals ``1`` but goes out as what the server refuses.  The key type refuses such a rank
now, so the tests set it past the checks, as a key changed after it was built has it.
Such a refused list is not reused for the well-formed list that follows it: that request
used to go out with the refused bytes, and was refused in its turn."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer


def _equal_lists(rank: object) -> tuple[list[ObjectKey], list[ObjectKey]]:
    """Three new keys of rank 1, and the same with ``rank`` instead."""
    hashes = [os.urandom(8) for _ in range(3)]
    keys = [ObjectKey("unit", 1, chunk_hash) for chunk_hash in hashes]
    odd = [ObjectKey("unit", 1, chunk_hash) for chunk_hash in hashes]
    for key in odd:
        msgspec.structs.force_setattr(key, "kv_rank", rank)
    assert odd == keys
    return keys, odd


@pytest.mark.parametrize("rank", [True, 1.0], ids=["bool", "float"])
def test_a_refused_key_list_does_not_stand_in_for_an_equal_well_formed_one(
    server: TiersServer, rank: object
) -> None:
    buffers = [np.full(64, index, dtype=np.uint8) for index in range(3)]
    with Client(server.endpoint, timeout=10.0) as client:
        keys, odd = _equal_lists(rank)
        with pytest.raises(ServerError, match="MALFORMED"):
            client.lookup(odd)
        assert client.lookup(keys) == 0
        keys, odd = _equal_lists(rank)
        with pytest.raises(ServerError, match="MALFORMED"):
            client.store(odd, buffers)
        assert client.store(keys, buffers) == len(keys)
        assert client.lookup(keys) == len(keys)
        client.release(keys)
