"""A LOOKUP's list of new keys comes out of the decoder as a LazyKeys: proven valid as a
whole, decoded only as far as something asks; every other list, and every list it cannot
prove valid that way, is decoded as before (and refused with the full decoder's error)."""

from __future__ import annotations

import pytest

from lmcache_tiers.controllers.prefetch_requests import unique_length
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.lazy_keys import LazyKeys
from lmcache_tiers.wire import decoding
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.decoding import KeyCache, decode_request


def prompt(count: int, tag: int = 0, **fields: object) -> list[ObjectKey]:
    """``count`` keys of one family, hashes of 32 bytes (about 60 bytes each encoded)."""
    return [
        ObjectKey(
            **{
                "model_name": "model",
                "kv_rank": 0,
                "cache_salt": "salt",
                **fields,  # type: ignore[arg-type]
                "chunk_hash": bytes([tag, index >> 8, index & 0xFF]) * 10 + b"\xc4\x90",
            }
        )
        for index in range(count)
    ]


def lookup_keys(cache: KeyCache, keys: list[ObjectKey]) -> object:
    header = p.encode(p.Lookup(1, "", keys))
    decoded = decode_request(header, cache)
    assert decoded == p.request_decoder.decode(header)
    assert isinstance(decoded, p.Lookup)
    return decoded.keys


@pytest.mark.parametrize("count", [16, 32, 100, 512])  # short and long headers (cut without msgspec)
def test_a_lookup_of_new_keys_decodes_only_its_first_key(count: int) -> None:
    cache = KeyCache()
    keys = prompt(count)
    decoded = lookup_keys(KeyCache(), keys)  # (compared with the full decoder's: all decoded)
    assert isinstance(decoded, LazyKeys)
    header = p.encode(p.Lookup(1, "", keys))
    lazy = decode_request(header, cache).keys  # type: ignore[attr-defined]
    assert isinstance(lazy, LazyKeys) and len(lazy) == count
    assert lazy[0] == keys[0] and lazy[-count] == keys[0] and lazy[:1] == keys[:1] and lazy[:0] == []
    assert unique_length(lazy, 0) == count
    assert len(cache) == 0, "nothing decoded past the first key, nor remembered"
    assert lazy[count - 1] == keys[-1]  # anything else decodes them all, through the cache
    assert list(lazy) == keys and lazy[5:9] == keys[5:9] and keys[3] in lazy
    assert len(cache) == count
    assert all(cache._keys[key.to_bytes()] is key for key in lazy)


def test_lists_that_are_not_lazy() -> None:
    cache = KeyCache()
    keys = prompt(64)
    assert type(lookup_keys(cache, keys[:15])) is list, "short lists are decoded at once"
    released = decode_request(p.encode(p.Release(1, "", prompt(64, tag=1))), cache)
    assert type(released.keys) is list, "only a LOOKUP's"  # type: ignore[attr-defined]
    lookup_keys(cache, keys[:1])
    assert type(lookup_keys(cache, keys)) is list, "its first key known: decoded as before"
    assert type(lookup_keys(cache, prompt(64, tag=1))) is list, "all known"


@pytest.mark.parametrize(
    "other",
    [
        {"model_name": "mode1"},  # other names, ranks, groups of the same encoded length
        {"cache_salt": "sal7"},
        {"kv_rank": 5},
        {"object_group": 3},
    ],
)
def test_a_list_mixing_keys_of_one_length_gives_each_its_own_fields(other: dict[str, object]) -> None:
    keys = prompt(64)
    odd = prompt(64, tag=9, **other)
    mixed = [*keys[:40], odd[40], *keys[41:]]
    assert len({len(key.to_bytes()) for key in mixed}) == 1
    decoded = lookup_keys(KeyCache(), mixed)
    assert list(decoded) == mixed  # type: ignore[call-overload]
    assert type(decoded) is list, "not provable from the first key: decoded whole"


@pytest.mark.parametrize("bad", [{"model_name": "mo@el"}, {"cache_salt": "sa/t"}, {"cache_salt": "sa\x00t"}])
def test_an_invalid_key_among_new_ones_is_refused_as_the_full_decoder_refuses_it(bad: dict[str, str]) -> None:
    """A key of the same encoded length whose name the checks refuse, deep in a list of new
    keys: the request is refused, with the full decoder's error, not answered a miss."""
    keys = prompt(300)
    valid = prompt(300, tag=7)[200]
    fields = {"model_name": valid.model_name, "kv_rank": 0, "chunk_hash": valid.chunk_hash, "object_group": 0}
    fields.update({"cache_salt": valid.cache_salt, **bad})
    # encoded by hand: ObjectKey itself refuses to build it
    invalid = p.encoder.encode([fields[name] for name in ObjectKey.__struct_fields__])
    assert len(invalid) == len(keys[0].to_bytes())
    elements = [key.to_bytes() for key in keys]
    elements[260] = invalid
    for count in (64, 300):  # short and long headers
        head = b"\xdc" + count.to_bytes(2, "big")
        header = b"\x95\x03\x01\xa0" + head + b"".join(elements[300 - count :]) + b"\x00"
        with pytest.raises(Exception) as full:
            p.request_decoder.decode(header)
        with pytest.raises(type(full.value)) as ours:
            decode_request(header, KeyCache())
        assert str(ours.value) == str(full.value)


def test_keys_encoded_otherwise_than_msgspec_does_are_decoded_at_once() -> None:
    """The hash's place in a piece is known only of the canonical encoding; a client writing
    the rank as a 4-byte integer gets its keys decoded one by one, as before."""
    keys = prompt(64, kv_rank=7)
    elements = [key.to_bytes().replace(b"\xa5model\x07", b"\xa5model\xce\x00\x00\x00\x07", 1) for key in keys]
    header = b"\x95\x03\x01\xa0\xdc\x00\x40" + b"".join(elements) + b"\x00"
    decoded = decode_request(header, KeyCache())
    assert decoded == p.request_decoder.decode(header) and type(decoded.keys) is list  # type: ignore[attr-defined]


def test_a_lazy_list_compares_as_the_list_of_its_keys() -> None:
    keys = prompt(40)
    lazy = decode_request(p.encode(p.Lookup(1, "", keys)), KeyCache()).keys  # type: ignore[attr-defined]
    assert isinstance(lazy, LazyKeys)
    assert lazy != prompt(40, tag=3) and lazy != keys[:39] and lazy != "not keys"
    assert lazy._decoded is None, "told apart by length, then by the first key"
    assert lazy == keys and keys == lazy and lazy == tuple(keys)
    with pytest.raises(TypeError):
        hash(lazy)
    assert "40 keys" in repr(lazy)


def test_repeated_keys_in_a_lazy_list_are_counted_once() -> None:
    keys = prompt(40)
    repeated = [*keys[:20], *keys[:20]]
    lazy = lookup_keys(KeyCache(), repeated)
    assert isinstance(lazy, LazyKeys) and not lazy.all_distinct()
    assert unique_length(lazy, 0) == 20


def test_the_threshold_is_what_the_tests_assume() -> None:
    assert decoding._LAZY_MIN_KEYS == 16


def test_a_cache_made_without_lazy_lookups_decodes_every_lookup() -> None:
    """A server with an L2 adapter asks it about every key: its decoder decodes them at once."""
    keys = prompt(64)
    decoded = lookup_keys(KeyCache(lazy_lookups=False), keys)
    assert type(decoded) is list and decoded == keys


@pytest.mark.parametrize("count", [32, 100, 512])  # short and long headers (cut without msgspec)
def test_a_new_prompt_looked_up_again_is_remembered_undecoded(count: int) -> None:
    """An engine asks about a waiting prompt at every scheduler step: its list is kept the
    second time, as any list, and handed out again as the very LazyKeys kept (nothing
    changes one), instead of being proven valid anew each time (512 keys: ~40 us a step).
    A request of another kind naming the same list gets a list of its own."""
    cache = KeyCache()
    keys = prompt(count)
    header = p.encode(p.Lookup(1, "", keys))
    for _ in range(2):  # the size a long header is cut at, learned as any list's
        decode_request(p.encode(p.Release(1, "", prompt(count, tag=5))), cache)
    known = len(cache)
    first, second, third = (decode_request(header, cache).keys for _ in range(3))  # type: ignore[attr-defined]
    assert all(isinstance(keys, LazyKeys) for keys in (first, second, third))
    assert third is second, "the list kept the second time"
    assert len(cache) == known, "no key decoded"
    assert unique_length(second, 0) == count
    assert third._distinct is True, "its distinct keys counted once for every LOOKUP of it"
    released = decode_request(p.encode(p.Release(2, "", keys)), cache).keys  # type: ignore[attr-defined]
    assert type(released) is list and released == keys
    again = decode_request(header, cache).keys  # type: ignore[attr-defined]
    assert again is second and again == keys, "decoded once, kept decoded"
    assert type(decode_request(p.encode(p.Release(3, "", keys)), cache).keys) is list  # type: ignore[attr-defined]
