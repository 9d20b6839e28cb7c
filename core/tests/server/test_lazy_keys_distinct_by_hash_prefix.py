"""A long LOOKUP of new keys is told whether its keys are distinct from the first 8 bytes
of their hashes; hashes alike there (or shorter than 8 bytes) leave it to the full check,
so repeated keys are counted once and distinct ones all counted, whichever way."""

from __future__ import annotations

import pytest

from lmcache_tiers.controllers.prefetch_requests import unique_length
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.lazy_keys import LazyKeys
from lmcache_tiers.wire import decoding
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.decoding import KeyCache, decode_request

COUNT = 512


def keyed(hashes: list[bytes]) -> list[ObjectKey]:
    return [ObjectKey("model", 0, chunk_hash, 0, "salt") for chunk_hash in hashes]


def decoded_lazily(keys: list[ObjectKey]) -> LazyKeys:
    header = p.encode(p.Lookup(1, "", keys))
    request = decode_request(header, KeyCache())
    assert request == p.request_decoder.decode(header)
    assert isinstance(request, p.Lookup) and isinstance(request.keys, LazyKeys)
    return request.keys


def test_the_threshold_is_above_the_tests_short_lists() -> None:
    assert decoding._LAZY_MIN_KEYS <= 16 < decoding._PREFIX_DISTINCT_MIN_KEYS <= COUNT


def test_keys_whose_hashes_differ_in_their_first_8_bytes_are_known_distinct_at_once() -> None:
    lazy = decoded_lazily(keyed([index.to_bytes(8, "big") * 4 for index in range(COUNT)]))
    assert lazy._distinct is True, "not told at decoding"
    assert lazy.all_distinct() and unique_length(lazy, 0) == COUNT


def test_keys_whose_hashes_differ_only_past_their_first_8_bytes_are_all_counted() -> None:
    lazy = decoded_lazily(keyed([bytes(8) + index.to_bytes(24, "big") for index in range(COUNT)]))
    assert lazy._distinct is None, "a shared prefix proves nothing: left to the full check"
    assert lazy.all_distinct() and unique_length(lazy, 0) == COUNT


@pytest.mark.parametrize("repeat_at", [1, 300, COUNT - 1])
def test_a_repeated_key_ends_the_distinct_prefix(repeat_at: int) -> None:
    hashes = [index.to_bytes(8, "big") * 4 for index in range(COUNT)]
    hashes[repeat_at] = hashes[0]
    lazy = decoded_lazily(keyed(hashes))
    assert not lazy.all_distinct()
    assert unique_length(lazy, 0) == repeat_at


def test_hashes_shorter_than_8_bytes_are_checked_whole() -> None:
    lazy = decoded_lazily(keyed([index.to_bytes(4, "big") for index in range(COUNT)]))
    assert lazy._distinct is None
    assert lazy.all_distinct() and unique_length(lazy, 0) == COUNT
    repeated = decoded_lazily(keyed([(index % 200).to_bytes(4, "big") for index in range(COUNT)]))
    assert not repeated.all_distinct() and unique_length(repeated, 0) == 200
