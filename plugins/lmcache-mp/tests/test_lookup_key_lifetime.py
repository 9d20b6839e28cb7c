"""A lookup keeps its keys (every rank of every chunk: the bulk of what a request
remembers at a large world size) only while it holds read locks on them: once it holds
none -- it hit nothing, or its retrieves consumed its locks, or they were freed -- the keys
go, and leave the remembered total, although the request goes on."""

from __future__ import annotations

from typing import Any

from lmcache_plugin_lmcache_mp.chunks import HASH_BYTES, LOOKUP_KEY_BYTES
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

#: four chunks at world size 8: 32 lookup keys
WIDE = Registration(world_size=8, num_layers=1, hidden_dim_size=8)
TOKENS_AND_HASHES = 4 * (256 * 4 + HASH_BYTES)


def _remembered(server: TiersServer) -> int:
    return int(server.frontends[0].shared.requests.remembered_bytes)


def _kept_keys(server: TiersServer, request_id: str) -> int:
    state = server.frontends[0].shared.requests.peek(request_id)
    assert state is not None, f"request {request_id} was forgotten"
    return 0 if state.job is None else len(state.job.keys)


def _store_every_rank(client: MPClient, shm: str, tokens: list[int]) -> None:
    for rank in range(WIDE.world_size):
        key = Key(tokens, f"store-{rank}", worker_id=rank, world_size=WIDE.world_size)
        assert client.store(key, WIDE.instance_id, chunk_payloads(rank, 4, WIDE.object_bytes), shm)


def _lookup_key(tokens: list[int], request_id: str, **fields: Any) -> Key:
    return Key(tokens, request_id, world_size=WIDE.world_size, **fields)


def test_a_lookup_that_hit_nothing_keeps_no_keys(make_mp_server: Any) -> None:
    server = make_mp_server()
    with MPClient(mp_address(server)) as client:
        client.register(WIDE)
        assert client.lookup(_lookup_key(tokens_of(1), "miss")) == 0
        assert _kept_keys(server, "miss") == 0
        assert _remembered(server) == TOKENS_AND_HASHES  # its tokens and hashes, for its next call


def test_a_lookup_keeps_its_keys_while_it_holds_locks_and_frees_them_after(make_mp_server: Any) -> None:
    server = make_mp_server()
    tokens = tokens_of(2)
    with MPClient(mp_address(server)) as client:
        shm = client.register(WIDE)["shm_name"]
        _store_every_rank(client, shm, tokens)
        stores = _remembered(server)  # the storing requests' tokens and hashes
        assert client.lookup(_lookup_key(tokens, "hit")) == 4
        assert _kept_keys(server, "hit") == 32
        assert _remembered(server) == stores + TOKENS_AND_HASHES + 32 * LOOKUP_KEY_BYTES
        # Each rank's retrieve consumes the lookup's lock on its keys: the last one frees them.
        for rank in range(WIDE.world_size):
            assert _kept_keys(server, "hit") == 32, f"freed before rank {rank} retrieved"
            retrieved = client.retrieve(_lookup_key(tokens, "hit", worker_id=rank), WIDE.instance_id, shm)
            assert retrieved == chunk_payloads(rank, 4, WIDE.object_bytes)
        assert _kept_keys(server, "hit") == 0
        assert _remembered(server) == stores + TOKENS_AND_HASHES
        assert server.storage.status()["l1"]["read_locks"] == 0
        # free_lookup_locks of every chunk frees them as well
        assert client.lookup(_lookup_key(tokens, "freed")) == 4
        assert client.call("free_lookup_locks", _lookup_key(tokens, "freed").encode(), 1) is None
        assert _kept_keys(server, "freed") == 0
        assert _remembered(server) == stores + 2 * TOKENS_AND_HASHES
