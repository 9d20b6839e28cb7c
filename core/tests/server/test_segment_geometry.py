"""The L1 segment a server lays out is one its local clients map, whatever the alignment.

The generation table starts at the first 8-byte boundary after the arena; a client knows
only that offset, and checks that the table has an entry for every block before it.  An
alignment that leaves the arena a few bytes short of that boundary (4095 here) must not
leave the table one entry short of the client's check: the client would fall back to
inline bytes, capped at the inline limit, for no reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer


@pytest.mark.parametrize("align", [64, 100, 4095, 4096])
def test_a_local_client_maps_the_segment_at_any_alignment(
    make_server: Callable[..., TiersServer], align: int
) -> None:
    server = make_server(l1_align_bytes=align)
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(3)]
    data = [os.urandom(size) for size in (1, align + 1, 5 * align - 1)]
    with Client(server.endpoint) as client:
        assert client.uses_shm, "the client could not map the server's segment"
        assert client.store(keys, data) == 3
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == data
