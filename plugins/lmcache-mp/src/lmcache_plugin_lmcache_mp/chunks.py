"""From LMCache cache keys to ObjectKeys, exactly as LMCache derives them.

The chunk hashes are core's (:func:`lmcache_tiers.plugin.chunk_hashes`: the blake3 chain
over full chunks of big-endian uint32 tokens, starting from LMCache's fixed initial hash),
so a chunk stored through this front end, the native one or LMCache itself has one key.
Each chunk becomes one ObjectKey per worker: ``kv_rank`` packs the world size and the
worker id as LMCache does, and the object group is 0 (the single full-attention group the
engine-driven path registers).

Every request sends its whole token sequence with each call; the hashes of a request are
kept (with the tokens they cover, packed, to check that the next call extends them) so a
long prompt stored range by range is hashed once.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from lmcache_plugin_lmcache_mp.wire import CacheKey
from lmcache_tiers.plugin import KeyValidationError, ObjectKey, chunk_hashes, kv_rank_of

__all__ = [
    "HASH_BYTES",
    "LOOKUP_KEY_BYTES",
    "ChunkRange",
    "HashCache",
    "chunk_range",
    "first_chunk",
    "full_chunks",
    "keys_for_all_ranks",
    "keys_for_rank",
    "remembered_bytes",
    "request_id_bytes",
]

#: what remembering one chunk hash costs: a 32-byte bytes object and its list slot
HASH_BYTES = 73
#: what remembering one token costs (packed as uint32)
TOKEN_BYTES = 4
#: what remembering one key of a lookup costs: an ObjectKey and its list slot (72 bytes;
#: its digest is the request's chunk hash, counted as HASH_BYTES) and, once the lookup hit
#: it, its entry among the read locks the lookup holds (up to 96 bytes, with the dict's
#: spare room); rounded up
LOOKUP_KEY_BYTES = 176


#: request id bytes counted as part of a request's fixed cost (which max_requests bounds):
#: LMCache's ids (vLLM's request ids) are far shorter
FREE_REQUEST_ID_BYTES = 1024


def request_id_bytes(request_id: str) -> int:
    """What remembering a request id costs beyond :data:`FREE_REQUEST_ID_BYTES`: ids are
    the clients' choice, up to an argument frame long, and one is kept per request."""
    return max(0, sys.getsizeof(request_id) - FREE_REQUEST_ID_BYTES)


def remembered_bytes(chunks: int, chunk_size: int, lookup_keys: int = 0) -> int:
    """What a request takes once its :class:`HashCache` covers ``chunks`` full chunks and
    its lookup holds ``lookup_keys`` keys."""
    return chunks * (chunk_size * TOKEN_BYTES + HASH_BYTES) + lookup_keys * LOOKUP_KEY_BYTES


@dataclass
class HashCache:
    """The chunk hashes of one request so far, and the tokens they cover."""

    tokens: array[int] = field(default_factory=lambda: array("I"))
    hashes: list[bytes] = field(default_factory=list)

    def hashes_of(self, tokens: Sequence[int], full_chunks: int, chunk_size: int) -> list[bytes]:
        """The hashes of the first ``full_chunks`` chunks of ``tokens``."""
        known = min(len(self.hashes), full_chunks)
        covered = known * chunk_size
        if known and array("I", tokens[:covered]) != self.tokens[:covered]:
            known = covered = 0  # another sequence under the same request id: start over
            self.tokens, self.hashes = array("I"), []
        if known < full_chunks:
            previous = self.hashes[known - 1] if known else None
            end = full_chunks * chunk_size
            fresh = (
                chunk_hashes(tokens[covered:end], chunk_size, previous)
                if previous is not None
                else chunk_hashes(tokens[:end], chunk_size)
            )
            del self.hashes[known:]
            self.hashes.extend(fresh)
            del self.tokens[covered:]
            self.tokens.extend(tokens[covered:end])
        return self.hashes[:full_chunks]

    def nbytes(self) -> int:
        """The memory the tokens and hashes take (see :func:`remembered_bytes`)."""
        return len(self.tokens) * TOKEN_BYTES + len(self.hashes) * HASH_BYTES


@dataclass(frozen=True)
class ChunkRange:
    """The chunks of a key's ``[start, end)``: indices ``first..last-1`` and their hashes."""

    first: int
    last: int
    hashes: list[bytes]  # of chunks first..last-1

    def __len__(self) -> int:
        return self.last - self.first


def chunk_range(key: CacheKey, chunk_size: int, cache: HashCache, *, from_zero: bool = False) -> ChunkRange:
    """The full chunks of ``key.token_ids[:end]`` at or after ``start`` (from chunk 0 with
    ``from_zero``, as a lookup counts); start and end are token indices, as in LMCache."""
    last = full_chunks(key, chunk_size)
    first = 0 if from_zero else min(last, first_chunk(key, chunk_size))
    hashes = cache.hashes_of(key.token_ids, last, chunk_size)
    return ChunkRange(first, last, hashes[first:last])


def full_chunks(key: CacheKey, chunk_size: int) -> int:
    """The full chunks of ``key.token_ids[:end]``: those a request's hashes cover."""
    return min(key.end, len(key.token_ids)) // chunk_size


def first_chunk(key: CacheKey, chunk_size: int) -> int:
    """The first full chunk at or after ``key.start``."""
    return -(-key.start // chunk_size)


def _check_world(key: CacheKey) -> None:
    if not 0 < key.world_size < 256:
        raise KeyValidationError(f"world_size {key.world_size} is outside 1..255")


def keys_for_rank(key: CacheKey, chunks: ChunkRange) -> list[ObjectKey]:
    """The objects one worker (``key.worker_id``) stores or retrieves for the range."""
    _check_world(key)
    if key.worker_id is None:
        raise KeyValidationError("a store or retrieve key needs a worker_id")
    rank = kv_rank_of(key.world_size, key.worker_id)
    return [ObjectKey(key.model_name, rank, digest, 0, key.cache_salt) for digest in chunks.hashes]


def keys_for_all_ranks(key: CacheKey, chunks: ChunkRange) -> list[ObjectKey]:
    """Every worker's object of every chunk, chunk by chunk: the leading keys present
    then cover whole chunks first, and a chunk counts only when all its ranks do."""
    _check_world(key)
    ranks = [kv_rank_of(key.world_size, worker) for worker in range(key.world_size)]
    return [
        ObjectKey(key.model_name, rank, digest, 0, key.cache_salt)
        for digest in chunks.hashes
        for rank in ranks
    ]
