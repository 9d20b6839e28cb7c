"""The bound on fenced reservations counts the L1 extents they hold, not their objects'
sizes.

A reservation that expires uncommitted is fenced: its extent is not reused until its
client says its copy is over.  While this front end's fenced reservations hold an eighth
of L1, stores are refused.  L1 aligns every extent (4 KiB by default), so a small object
holds several times its size: counted by object size, a client registering a small
layout could fence many times the bound before any store was refused.  The server's own
sweeps expire the reservations (a short write TTL): no timing assertions.
"""

from __future__ import annotations

from typing import Any

from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, mp_address, tokens_of, wait_for

#: a 1 KiB chunk object, whose L1 extent is a whole 4 KiB
SMALL = Registration(num_layers=1, hidden_dim_size=1, num_physical_slots=256)
#: about 734 KiB: the bound is an eighth of it, about 23 extents of 4 KiB or 91 objects of 1 KiB
L1_GB = 0.0007
#: uncommitted reservations: over the bound in extents, well under it in object bytes
STALLED = 30


def one_chunk(sequence: int) -> Key:
    return Key(tokens_of(sequence), f"r{sequence}", worker_id=0, end=CHUNK_TOKENS)


def test_fenced_reservations_of_small_objects_reach_the_bound_by_their_extents(make_mp_server: Any) -> None:
    server = make_mp_server(l1_size_gb=L1_GB, l1_write_ttl_s=1.0, l1_lock_ttl_s=1.0)
    transfers: Any = server.frontends[0].handlers.transfers  # type: ignore[attr-defined]
    assert SMALL.object_bytes == 1024
    with MPClient(mp_address(server)) as client:
        client.register(SMALL)
        for sequence in range(STALLED):
            prepared = client.call("prepare_store", one_chunk(sequence).encode(), SMALL.instance_id)
            assert len(prepared["context"]["slots"]) == 1
        wait_for(
            lambda: sum(len(fenced) for fenced in transfers.writes.fenced.values()) == STALLED,
            "the stalled reservations were never fenced",
        )
        assert transfers.writes.fenced_bytes >= transfers.fenced_bytes_bound
        prepared = client.call("prepare_store", one_chunk(STALLED).encode(), SMALL.instance_id)
        assert prepared["context"]["slots"] == []
        assert mp_stats(server).failures["mp_store_refused_fenced"] == 1
