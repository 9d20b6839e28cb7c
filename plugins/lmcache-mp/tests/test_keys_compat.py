"""The keys this front end derives are LMCache's, figure for figure."""

from __future__ import annotations

import pytest
from lmcache_plugin_lmcache_mp.chunks import HashCache, chunk_range, keys_for_all_ranks, keys_for_rank
from lmcache_plugin_lmcache_mp.wire import CacheKey
from mpclient import tokens_of

from lmcache_tiers.plugin import NONE_HASH, KeyValidationError, ObjectKey, chunk_hashes, kv_rank_of

#: the first chunk hashes of LMCache 0.5.6's server for (0,) + (9906,) * 1024, chunk 256:
#: also the names of the files its fs L2 writes
REFERENCE_PREFIXES = ["d65391f7", "4d033f8a", "052ad337", "e3edc710"]


def key(tokens: list[int], **fields: object) -> CacheKey:
    values: dict[str, object] = {
        "model_name": "test-model",
        "world_size": 1,
        "worker_id": 0,
        "token_ids": tokens,
        "start": 0,
        "end": len(tokens),
        "request_id": "r",
    }
    values.update(fields)
    return CacheKey(**values)  # type: ignore[arg-type]


def test_initial_hash_and_chunk_hashes_match_lmcache() -> None:
    assert NONE_HASH.hex() == "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
    hashes = chunk_hashes(tokens_of(0), 256)
    assert [digest.hex()[:8] for digest in hashes] == REFERENCE_PREFIXES  # the tail token is dropped


def test_kv_rank_packing_matches_lmcache() -> None:
    assert kv_rank_of(1, 0) == 0x01000100
    assert kv_rank_of(4, 3) == 4 << 24 | 3 << 16 | 4 << 8 | 3


def test_store_keys_are_the_native_clients_keys() -> None:
    from lmcache_tiers.keys import prefix_keys

    tokens = tokens_of(3)
    mine = keys_for_rank(key(tokens), chunk_range(key(tokens), 256, HashCache()))
    assert mine == prefix_keys(tokens, 256, model_name="test-model", kv_rank=0x01000100)


def test_ranges_pick_chunks_by_token_index() -> None:
    tokens = tokens_of(1)
    full = chunk_range(key(tokens), 256, HashCache())
    middle = chunk_range(key(tokens, start=256, end=768), 256, HashCache())
    assert (middle.first, middle.last) == (1, 3) and middle.hashes == full.hashes[1:3]
    ragged = chunk_range(key(tokens, start=100, end=700), 256, HashCache())  # rounded inwards
    assert (ragged.first, ragged.last) == (1, 2)
    lookup = chunk_range(key(tokens, start=512), 256, HashCache(), from_zero=True)
    assert (lookup.first, lookup.last) == (0, 4)


def test_lookup_keys_are_chunk_major_over_every_rank() -> None:
    tokens = tokens_of(2)
    lookup = key(tokens, world_size=2, worker_id=None)
    expanded = keys_for_all_ranks(lookup, chunk_range(lookup, 256, HashCache(), from_zero=True))
    assert len(expanded) == 8
    assert [k.kv_rank for k in expanded[:2]] == [kv_rank_of(2, 0), kv_rank_of(2, 1)]
    assert expanded[0].chunk_hash == expanded[1].chunk_hash != expanded[2].chunk_hash
    with pytest.raises(KeyValidationError):
        keys_for_rank(lookup, chunk_range(lookup, 256, HashCache()))  # no worker_id


def test_the_hash_cache_extends_and_notices_another_sequence() -> None:
    cache = HashCache()
    tokens = tokens_of(5, 2048)
    assert cache.hashes_of(tokens[:600], 2, 256) == chunk_hashes(tokens[:512], 256)
    assert cache.hashes_of(tokens, 8, 256) == chunk_hashes(tokens, 256)  # extends from chunk 2
    other = tokens_of(6, 2048)
    assert cache.hashes_of(other, 8, 256) == chunk_hashes(other, 256)  # starts over


def test_salt_and_model_go_into_the_object_key() -> None:
    tokens = tokens_of(0)
    salted = key(tokens, cache_salt="tenant-a", model_name="meta-llama/Llama-3.1-8B")
    first = keys_for_rank(salted, chunk_range(salted, 256, HashCache()))[0]
    assert first == ObjectKey("meta-llama/Llama-3.1-8B", 0x01000100, first.chunk_hash, 0, "tenant-a")
    assert first.chunk_hash.hex().startswith(REFERENCE_PREFIXES[0])  # the salt is not hashed
