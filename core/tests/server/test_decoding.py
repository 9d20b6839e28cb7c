"""decode_request: the same requests and the same refusals as protocol.request_decoder,
with keys recognised by their bytes."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import msgspec
import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.decoding import KeyCache, decode_request

KEY = ObjectKey("meta-llama/Llama-3.1-8B", 7, b"\x01" * 32, 2, "tenant")
OTHER = ObjectKey("model", 0, b"\x02" * 16)

REQUESTS: list[p._Request] = [
    p.Hello(1, "tok", p.PROTOCOL_VERSION, "engine", 42),
    p.Ping(2, ""),
    p.Lookup(3, "tok", [KEY, OTHER]),
    p.QueryPrefetchStatus(4, "", 9),
    p.WaitPrefetchStatus(5, "", 9, 1.5),
    p.StoreReserve(6, "", [KEY, OTHER], [4096, 8192]),
    p.StoreReserve(6, "", [KEY], [4096], ["uint8[4096]"]),
    p.StoreCommit(7, "", [KEY], True),
    p.StoreAbort(8, "", [OTHER]),
    p.StoreInline(9, "", [KEY], ["uint8[4096]"], True),
    p.Retrieve(10, "", [KEY, OTHER], True),
    p.Release(11, "", [OTHER, KEY]),
    p.Clear(12, "", True),
    p.Status(13, ""),
    p.Evict(14, "", [KEY]),
    p.Lookup(15, "", []),
]


def outcome(decode: Any, header: bytes) -> tuple[str, Any]:
    """What a decoder makes of ``header``: ("ok", request) or (error type, message)."""
    try:
        return "ok", decode(header)
    except Exception as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_request_decodes_as_with_the_full_decoder(request_: p._Request) -> None:
    cache = KeyCache()
    header = p.encode(request_)
    first = decode_request(header, cache)
    assert type(first) is type(request_)
    assert first == request_ == p.request_decoder.decode(header)
    again = decode_request(header, cache)
    assert again == request_
    for before, after in zip(getattr(first, "keys", []), getattr(again, "keys", []), strict=True):
        assert after is before  # the remembered key itself, not an equal copy


def test_a_key_is_the_same_object_whatever_request_names_it() -> None:
    cache = KeyCache()
    stored = decode_request(p.encode(p.StoreReserve(1, "", [KEY], [4096])), cache)
    looked_up = decode_request(p.encode(p.Lookup(2, "", [OTHER, KEY])), cache)
    assert isinstance(stored, p.StoreReserve) and isinstance(looked_up, p.Lookup)
    assert looked_up.keys[1] is stored.keys[0]
    assert len(cache) == 2


MALFORMED_KEYS: list[Any] = [
    ["", 0, b"\x01"],  # empty model name
    ["a@b", 0, b"\x01"],  # separator in the model name
    ["m" * 257, 0, b"\x01"],  # model name too long
    ["model", -1, b"\x01"],  # negative kv_rank
    ["model", 1 << 32, b"\x01"],  # kv_rank over 32 bits
    ["model", 0, b""],  # empty chunk hash
    ["model", 0, b"\x01" * 65],  # chunk hash too long
    ["model", 0, b"\x01", 1 << 16],  # object_group out of range
    ["model", 0, b"\x01", 0, "a/b"],  # path separator in the salt
    ["model", 0, b"\x01", 0, "s" * 129],  # salt too long
    ["model", 0, "not bytes"],  # wrong type
    ["model", 0],  # too short
    "not an array",
]


@pytest.mark.parametrize("bad", MALFORMED_KEYS, ids=repr)
@pytest.mark.parametrize("op", [p.Op.LOOKUP, p.Op.STORE_RESERVE, p.Op.RETRIEVE, p.Op.RELEASE])
def test_a_malformed_key_is_refused_with_the_full_decoders_error(bad: Any, op: p.Op) -> None:
    cache = KeyCache()
    good = list(msgspec.msgpack.decode(KEY.to_bytes()))
    decode_request(p.encode(p.Lookup(1, "", [KEY])), cache)  # KEY is remembered
    tail = {p.Op.STORE_RESERVE: [[4096, 4096, 4096]], p.Op.RETRIEVE: [False]}.get(op, [])
    header = msgpack.packb([op.value, 5, "", [good, bad, good], *tail], use_bin_type=True)
    expected = outcome(p.request_decoder.decode, header)
    assert expected[0] == "ValidationError"
    assert outcome(lambda data: decode_request(data, cache), header) == expected
    assert len(cache) == 1  # nothing of the refused request was remembered but KEY


def test_keys_encoded_another_way_decode_to_the_same_keys() -> None:
    """Another client library may send trailing defaults left out, or wider integers; a
    newer one a trailing field this version does not know (msgspec ignores it)."""
    cache = KeyCache()
    short = msgpack.packb([p.Op.LOOKUP.value, 1, "", [["model", 0, b"\x02" * 16]]], use_bin_type=True)
    longer = msgpack.packb([p.Op.LOOKUP.value, 1, "", [["model", 0, b"\x02" * 16, 0, "", "new"]]])
    wide = b"".join(
        [
            b"\x94\x03\x02\xa0\x91\x95",
            b"\xd9\x05model",  # str8 where fixstr would do
            b"\xce\x00\x00\x00\x00",  # uint32 zero
            b"\xc4\x10" + b"\x02" * 16,
            b"\xcd\x00\x00",  # uint16 zero
            b"\xa0",
        ]
    )
    for header in (short, longer, wide, p.encode(p.Lookup(1, "", [OTHER]))):
        decoded = decode_request(header, cache)
        assert decoded == p.request_decoder.decode(header)
        assert isinstance(decoded, p.Lookup) and decoded.keys == [OTHER]


def test_the_other_fields_keep_their_limits() -> None:
    cache = KeyCache()
    headers = [
        msgpack.packb([p.Op.LOOKUP.value, -1, "", []]),  # negative req_id
        msgpack.packb([p.Op.LOOKUP.value, 1, "t" * 257, []]),  # token too long
        msgpack.packb([p.Op.STORE_RESERVE.value, 1, "", [], [0]]),  # size 0
        msgpack.packb([p.Op.STORE_RESERVE.value, 1, "", [], [], ["x" * 300]]),  # layout too long
        msgpack.packb([p.Op.RETRIEVE.value, 1, "", [], "yes"]),  # inline not a bool
        msgpack.packb([p.Op.LOOKUP.value, 1, "", [None] * (p.MAX_KEYS_PER_REQUEST + 1)]),
        msgpack.packb([99, 1, ""]),  # unknown op
        b"\x93\x02",  # truncated
    ]
    for header in headers:
        expected = outcome(p.request_decoder.decode, header)
        assert expected[0] != "ok"
        assert outcome(lambda data: decode_request(data, cache), header) == expected
    assert len(cache) == 0


def test_mutated_headers_get_the_full_decoders_verdict() -> None:
    """Random byte flips of real headers: same request or same error, every time."""
    seeds = [p.encode(request) for request in REQUESTS if hasattr(request, "keys")]
    check_mutations(random.Random(16), KeyCache(), seeds)


def check_mutations(rng: random.Random, cache: KeyCache, seeds: list[bytes]) -> None:
    """Flip 1-3 random bytes of a seed header, 3000 times: decode_request must give the
    full decoder's request or its error each time."""
    for _ in range(3000):
        header = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        data = bytes(header)
        expected = outcome(p.request_decoder.decode, data)
        assert outcome(lambda raw: decode_request(raw, cache), data) == expected


def test_the_cache_is_bounded() -> None:
    cache = KeyCache(entries=8)
    for round_ in range(20):
        keys = [ObjectKey("model", 0, bytes([round_, index]) * 8) for index in range(3)]
        decoded = decode_request(p.encode(p.Lookup(round_, "", keys)), cache)
        assert isinstance(decoded, p.Lookup) and decoded.keys == keys
        assert len(cache) <= 8
    # A batch larger than the bound is still decoded whole (and remembered until the next).
    many = [ObjectKey("model", 0, index.to_bytes(4, "big")) for index in range(20)]
    decoded = decode_request(p.encode(p.Release(1, "", many)), cache)
    assert isinstance(decoded, p.Release) and decoded.keys == many
    assert len(cache) == 20


SAME_SIZE = [ObjectKey("model", 0, index.to_bytes(2, "big") * 8, 0, "salt") for index in range(300)]


def test_keys_of_one_size_decode_to_the_remembered_keys() -> None:
    """Keys that all encode to the same length are cut from the key list in one pass once
    known: the same keys, the same objects, at every length of the array header."""
    cache = KeyCache()
    for count in (1, 15, 16, 300):  # fixarray, and array 16
        header = p.encode(p.Lookup(count, "", SAME_SIZE[:count]))
        first = decode_request(header, cache)
        again = decode_request(header, cache)
        assert first == again == p.request_decoder.decode(header)
        assert isinstance(again, p.Lookup) and isinstance(first, p.Lookup)
        assert all(a is b for a, b in zip(again.keys, first.keys, strict=True))
    array32 = b"\xdd" + (3).to_bytes(4, "big") + b"".join(key.to_bytes() for key in SAME_SIZE[:3])
    header = b"\x94\x03\x01\xa0" + array32
    assert decode_request(header, cache) == p.request_decoder.decode(header)


def test_keys_of_other_sizes_cut_at_the_wrong_places_still_decode() -> None:
    """Known keys of two sizes whose list divides evenly: equal pieces would straddle key
    boundaries, are not known, and the list is split key by key instead."""
    short = ObjectKey("model", 0, b"\x03" * 10)
    long = ObjectKey("model", 0, b"\x04" * 12)
    assert len(long.to_bytes()) - len(short.to_bytes()) == 2
    cache = KeyCache()
    decode_request(p.encode(p.Lookup(1, "", [short, long])), cache)
    header = p.encode(p.Lookup(2, "", [short, long, long, short]))
    decoded = decode_request(header, cache)
    assert decoded == p.request_decoder.decode(header)
    assert isinstance(decoded, p.Lookup) and decoded.keys == [short, long, long, short]


def test_new_keys_of_other_sizes_cut_at_the_wrong_places_still_decode() -> None:
    """The same with keys never seen: the equal pieces are decoded as new keys, a piece
    straddling two keys is not a whole key, and the list is split key by key instead."""
    short = ObjectKey("model", 0, b"\x05" * 10)
    long = ObjectKey("model", 0, b"\x06" * 12)
    for keys in ([short, long, long, short], [short, short, long, long] * 4):
        assert sum(len(key.to_bytes()) for key in keys) % len(keys) == 0  # equal pieces exist
        header = p.encode(p.StoreReserve(1, "", keys, [1] * len(keys)))
        decoded = decode_request(header, KeyCache())
        assert decoded == p.request_decoder.decode(header)
        assert isinstance(decoded, p.StoreReserve) and decoded.keys == keys


def test_mutated_headers_of_new_same_size_keys_get_the_full_decoders_verdict() -> None:
    seeds = [p.encode(p.StoreReserve(1, "", SAME_SIZE[:count], [1] * count)) for count in (3, 20)]
    rng = random.Random(23)
    for _ in range(20):
        check_mutations(rng, KeyCache(), seeds)  # every key new each time: decoded from the pieces


def test_mutated_headers_of_same_size_keys_get_the_full_decoders_verdict() -> None:
    cache = KeyCache()
    seeds = [p.encode(kind(1, "", SAME_SIZE[:count])) for kind in (p.Lookup, p.Release) for count in (3, 20)]
    for seed in seeds:
        decode_request(seed, cache)  # every key known: the equal-piece path is taken
    check_mutations(random.Random(17), cache, seeds)


def test_a_key_list_seen_before_is_handed_out_again_as_a_list_of_its_own() -> None:
    """A repeated key list (one memcmp instead of a probe per key) gives the same keys,
    the same objects, in a new list each time: a caller changing one changes no other."""
    cache = KeyCache()
    header = p.encode(p.Release(1, "", SAME_SIZE[:64]))
    first = decode_request(header, cache)
    assert isinstance(first, p.Release)
    first.keys.reverse()
    again = decode_request(p.encode(p.Retrieve(2, "", SAME_SIZE[:64], True)), cache)
    assert isinstance(again, p.Retrieve) and again.keys == SAME_SIZE[:64]
    assert again.keys is not first.keys
    assert all(a is b for a, b in zip(again.keys, reversed(first.keys), strict=True))


def test_key_lists_alike_at_their_end_are_told_apart() -> None:
    """Lists are found by their length and last bytes, then compared whole: lists of one
    length ending with the same key, taken in turns, each decode to their own keys."""
    cache = KeyCache()
    tail = SAME_SIZE[299]
    lists = [[SAME_SIZE[index], SAME_SIZE[index + 1], tail] for index in range(0, 12, 2)]
    for round_ in range(3):
        for number, keys in enumerate(lists):
            header = p.encode(p.Lookup(round_ * 100 + number, "", keys))
            decoded = decode_request(header, cache)
            assert decoded == p.request_decoder.decode(header)


def test_remembered_key_lists_are_bounded_and_follow_the_key_cache() -> None:
    cache = KeyCache(entries=64)
    for round_ in range(300):
        keys = [ObjectKey("model", 0, bytes([round_ % 256, round_ // 256, index]) * 8) for index in range(2)]
        decoded = decode_request(p.encode(p.Lookup(round_, "", keys)), cache)
        assert isinstance(decoded, p.Lookup) and decoded.keys == keys
        assert len(cache._lists) <= 256
    # The key cache was emptied on the way: a list remembered before that would hand out
    # keys the cache no longer holds, so none is kept across it.
    keys = [ObjectKey("model", 0, bytes([7, index]) * 8) for index in range(40)]
    header = p.encode(p.Lookup(1, "", keys))
    decode_request(header, cache)
    fresh = [ObjectKey("model", 0, bytes([8, index]) * 8) for index in range(40)]
    decode_request(p.encode(p.Lookup(2, "", fresh)), cache)  # 80 keys: over 64, emptied
    decoded = decode_request(header, cache)
    assert isinstance(decoded, p.Lookup)
    assert all(cache._keys[key.to_bytes()] is key for key in decoded.keys)


def test_a_key_list_is_kept_when_it_comes_again_soon_and_never_copied_otherwise() -> None:
    """The first sighting notes a list's length and last bytes only; coming again before
    `_SIGHTED_MAX` other new lists keeps it; lists that each return only after more new
    lists than that are never kept (copying each would cost every new prefix)."""
    from lmcache_tiers.wire import decoding

    cache = KeyCache()
    header = p.encode(p.Release(1, "", SAME_SIZE[:64]))  # (a LOOKUP's new keys stay undecoded)
    decode_request(header, cache)
    assert cache._lists == {}, "seen once: only noted"
    decode_request(header, cache)
    assert len(cache._lists) == 1, "seen again soon: kept"
    cycle = decoding._SIGHTED_MAX + 8
    others = [
        [ObjectKey("cycle", 0, bytes([n % 256, n // 256, i]) * 8) for i in range(8)] for n in range(cycle)
    ]
    for round_ in range(3):
        for number, keys in enumerate(others):
            decoded = decode_request(p.encode(p.Lookup(round_ * cycle + number, "", keys)), cache)
            assert isinstance(decoded, p.Lookup) and decoded.keys == keys
    assert len(cache._lists) == 1, "lists returning after more new lists than noted are not copied"


def decoded_keys(cache: KeyCache, keys: list[ObjectKey], req_id: int = 1) -> list[ObjectKey]:
    header = p.encode(p.Lookup(req_id, "", keys))
    decoded = decode_request(header, cache)
    assert decoded == p.request_decoder.decode(header)
    assert isinstance(decoded, p.Lookup)
    return decoded.keys


def record_runs_found(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each look for runs of remembered lists found the keys, in order."""
    found: list[bool] = []
    runs = KeyCache._runs_of_seen_lists

    def recorded(self: KeyCache, *args: Any) -> list[ObjectKey] | None:
        keys = runs(self, *args)
        found.append(keys is not None)
        return keys

    monkeypatch.setattr(KeyCache, "_runs_of_seen_lists", recorded)
    return found


def test_runs_of_a_stored_list_decode_from_it_in_one_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys first decoded in one list (a STORE of a prompt): later lists that are runs of it
    -- its prefixes, windows, a run across two such lists -- are its keys, the very objects,
    taken by the run path without cutting the list into pieces."""
    cache = KeyCache()
    stored = decode_request(p.encode(p.StoreReserve(1, "", SAME_SIZE[:200], [4096] * 200)), cache)
    more = decode_request(p.encode(p.StoreReserve(2, "", SAME_SIZE[200:], [4096] * 100)), cache)
    assert isinstance(stored, p.StoreReserve) and isinstance(more, p.StoreReserve)
    known = stored.keys + more.keys
    found = record_runs_found(monkeypatch)
    cases = ((0, 200), (0, 40), (37, 150), (150, 120), (160, 40), (163, 37), (0, 300))
    for first, count in cases:
        keys = decoded_keys(cache, SAME_SIZE[first : first + count], first * 1000 + count)
        assert keys == SAME_SIZE[first : first + count]
        assert all(a is b for a, b in zip(keys, known[first : first + count], strict=True))
    assert found == [True] * len(cases)


def test_every_eighth_new_key_is_remembered_where_it_came_and_runs_are_found_by_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Remembering where each new key came was most of the cost of decoding a list of new
    keys: every eighth is, and a run is found by the first of its first eight keys that is.
    A run that would start before the list found, and a list too short to look for runs in,
    are cut into pieces instead."""
    from lmcache_tiers.wire import decoding

    cache = KeyCache()
    decoded_keys(cache, SAME_SIZE[:200])
    decoded_keys(cache, SAME_SIZE[200:300])
    assert len(cache._origins) == 200 // 8 + 100 // 8 + 1
    assert sorted(position for _, position in cache._origins.values()) == sorted(
        [*range(0, 200, 8), *range(0, 100, 8)]
    )
    found = record_runs_found(monkeypatch)
    for first, count, expected in (
        (1, 100, [True]),
        (195, 40, [False]),
        (7, decoding._RUN_LOOKUP_MIN_KEYS - 1, []),
    ):
        found.clear()
        assert decoded_keys(cache, SAME_SIZE[first : first + count]) == SAME_SIZE[first : first + count]
        assert found == expected, (first, count)


def test_lists_that_are_not_runs_decode_as_before() -> None:
    """A list starting like a stored one and going on differently, keys of another size in
    between, a run longer than what is left of the stored list followed by unknown keys:
    each gives the full decoder's keys."""
    cache = KeyCache()
    decoded_keys(cache, SAME_SIZE[:100])
    other_size = ObjectKey("model", 0, b"\x05" * 20, 0, "salt")
    unknown = [ObjectKey("model", 0, index.to_bytes(2, "big") * 8, 0, "tlas") for index in range(5)]
    for keys in (
        SAME_SIZE[:10] + SAME_SIZE[50:60],  # same first key, another continuation
        [*SAME_SIZE[:10], other_size, *SAME_SIZE[10:20]],
        SAME_SIZE[90:100] + unknown,  # past the end of the stored list, then new keys
        SAME_SIZE[90:100] + SAME_SIZE[200:210],  # past its end, then keys never seen
        list(reversed(SAME_SIZE[:40])),
        [SAME_SIZE[3]] * 12,  # one key repeated
    ):
        assert decoded_keys(cache, keys) == keys
    # more pieces than _RUNS_MAX: still decoded, by cutting the list
    hops = [key for start in range(0, 60, 10) for key in SAME_SIZE[start : start + 2]]
    assert decoded_keys(cache, hops) == hops


def test_mutated_headers_of_runs_get_the_full_decoders_verdict() -> None:
    cache = KeyCache()
    decode_request(p.encode(p.StoreReserve(1, "", SAME_SIZE[:64], [10] * 64)), cache)
    seeds = [
        p.encode(kind(1, "", SAME_SIZE[start : start + 20]))
        for kind in (p.Lookup, p.Release)
        for start in (0, 7)
    ]
    check_mutations(random.Random(18), cache, seeds)


def test_origins_are_forgotten_with_the_key_cache() -> None:
    cache = KeyCache(entries=64)
    decoded_keys(cache, SAME_SIZE[:40])
    assert cache._origins
    # 40 known and 30 new keys: over 64 in all, so the cache is emptied before the new ones
    decoded_keys(cache, [*SAME_SIZE[:40], *SAME_SIZE[100:130]])
    assert all(seen.keys[position] is cache._keys[data] for data, (seen, position) in cache._origins.items())
    # every key a remembered list would hand out is the cache's own object
    kept = {id(seen): seen for seen, _ in cache._origins.values()}
    assert all(cache._keys[key.to_bytes()] is key for seen in kept.values() for key in seen.keys)
    keys = decoded_keys(cache, SAME_SIZE[:40])
    assert all(cache._keys[key.to_bytes()] is key for key in keys)


def test_remembered_origins_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client bringing one new key in each long list: the lists kept as origins stay
    within their byte budget, and keys still decode right after origins are forgotten."""
    from lmcache_tiers.wire import decoding

    monkeypatch.setattr(decoding, "_ORIGIN_BYTES_MAX", 64 << 10)
    cache = KeyCache()
    base = SAME_SIZE[:200]
    for round_ in range(40):
        fresh = ObjectKey("model", 0, round_.to_bytes(2, "big") * 8, 0, "tlas")
        assert decoded_keys(cache, [*base, fresh], round_) == [*base, fresh]
        assert cache._origin_bytes <= 64 << 10
        kept = {id(seen): seen for seen, _ in cache._origins.values()}
        assert sum(len(seen.elements) + 8 * len(seen.keys) for seen in kept.values()) <= 64 << 10
    assert decoded_keys(cache, base[50:150]) == base[50:150]


# -- long headers: the key list located and cut without msgspec walking it ---------------------

#: enough keys for a header over decoding._CUT_MIN_BYTES
LONG = SAME_SIZE[:120]


class RecordingDecoder:
    """Stands in for decoding._fast_decoder: decodes with it and notes each header's length."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, data: bytes) -> Any:
        self.lengths.append(len(data))
        return self.inner.decode(data)


def keyed_requests(keys: list[ObjectKey]) -> list[p._Request]:
    count = len(keys)
    return [
        p.Lookup(1, "tok", keys, 2.5),
        p.StoreReserve(2 << 40, "", keys, [4096] * count, ["uint8[4096]"] * count),
        p.StoreCommit(3, "t" * 40, keys, True),
        p.StoreAbort(4, "", keys),
        p.StoreInline(5, "", keys, [], True),
        p.Retrieve(6, "", keys, True, ["uint8[4096]"] * count),
        p.Release(7, "", keys, True),
        p.Evict(8, "", keys),
    ]


def test_a_long_list_of_known_keys_is_not_walked_by_msgspec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind of request naming keys, its key list of known keys: msgspec decodes the
    header with the list left out (a few bytes in its place), and the request is the full
    decoder's, with the remembered key objects."""
    from lmcache_tiers.wire import decoding

    cache = KeyCache()
    remembered = decoded_keys(cache, LONG)
    recording = RecordingDecoder(decoding._fast_decoder)
    monkeypatch.setattr(decoding, "_fast_decoder", recording)
    for request in keyed_requests(LONG):
        header = p.encode(request)
        assert len(header) >= 3000  # over decoding._CUT_MIN_BYTES
        recording.lengths.clear()
        decoded = decode_request(header, cache)
        assert decoded == p.request_decoder.decode(header) == request
        assert all(a is b for a, b in zip(decoded.keys, remembered, strict=True))  # type: ignore[attr-defined]
        keys_bytes = len(p.encode(LONG))
        assert recording.lengths and max(recording.lengths) <= len(header) - keys_bytes + 1, type(request)


def test_a_long_list_of_new_keys_is_not_walked_by_msgspec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys never seen, of a size lists were cut at before (a new prompt looked up or
    stored): the header is decoded with the list left out too, and the keys are the full
    decoder's, each remembered (a key repeated in the list included)."""
    from lmcache_tiers.wire import decoding

    cache = KeyCache()
    decoded_keys(cache, LONG)  # notes their size
    recording = RecordingDecoder(decoding._fast_decoder)
    monkeypatch.setattr(decoding, "_fast_decoder", recording)
    for number, request in enumerate(keyed_requests(LONG)):
        fresh = [ObjectKey("model", 0, bytes([number, index]) * 8, 0, "salt") for index in range(119)]
        keys = [*fresh, fresh[7]]
        header = p.encode(msgspec.structs.replace(request, keys=keys))
        recording.lengths.clear()
        decoded = decode_request(header, cache)
        assert decoded == p.request_decoder.decode(header)
        assert decoded.keys == keys  # type: ignore[attr-defined]
        keys_bytes = len(p.encode(keys))
        assert recording.lengths and max(recording.lengths) <= len(header) - keys_bytes + 1, type(request)
        assert all(cache._keys[key.to_bytes()] == key for key in keys)


def test_long_lists_of_new_keys_that_are_not_whole_keys_get_the_full_decoders_verdict() -> None:
    """A never-seen list whose first piece decodes at a remembered size but whose others do
    not (a key out of range, keys of another size after it, a list cut short): decoded
    the usual way, so refused or accepted as the full decoder does."""
    cache = KeyCache()
    decoded_keys(cache, LONG)
    fresh = [ObjectKey("model", 0, index.to_bytes(2, "big") * 8, 0, "tlas") for index in range(1000, 1120)]
    longer = [ObjectKey("another-model", 0, bytes([index]) * 20) for index in range(60)]
    out_of_range = msgspec.msgpack.encode(["model", 1 << 32, bytes(8), 0, "tlas"])  # a key's size
    cases = [p.encode(p.Lookup(1, "", [*fresh[:60], *longer]))]
    for keys in (fresh, fresh[:60]):
        header = p.encode(p.Lookup(1, "", keys))
        cases += [header[:-7], header + b"\x00"]
        at = header.index(keys[30].to_bytes())
        assert len(out_of_range) == len(keys[30].to_bytes())
        cases.append(header[:at] + out_of_range + header[at + len(out_of_range) :])
    assert outcome(p.request_decoder.decode, cases[-1])[0] == "ValidationError"
    for header in cases:
        assert outcome(lambda data: decode_request(data, cache), header) == outcome(
            p.request_decoder.decode, header
        )


def test_a_long_list_cut_anew_each_time_and_in_runs() -> None:
    """Known keys in an order no list had (cut into pieces), windows of a remembered list
    (runs), a list seen twice (remembered whole), a known first key followed by new keys
    of its size (decoded from the pieces): the full decoder's request every time."""
    cache = KeyCache()
    decoded_keys(cache, SAME_SIZE[:200])
    fresh = [ObjectKey("model", 0, index.to_bytes(2, "big") * 8, 0, "tlas") for index in range(100)]
    for keys in (
        list(reversed(SAME_SIZE[:150])),
        SAME_SIZE[30:130],
        SAME_SIZE[30:130],
        SAME_SIZE[30:130],
        [SAME_SIZE[5], *fresh],
        [*SAME_SIZE[:60], *fresh[:60]],
    ):
        header = p.encode(p.Lookup(9, "", keys))
        decoded = decode_request(header, cache)
        assert decoded == p.request_decoder.decode(header)
        assert isinstance(decoded, p.Lookup) and decoded.keys == keys
    assert cache._keys[fresh[0].to_bytes()] == fresh[0]


def test_long_lists_of_keys_of_other_sizes_after_a_known_first_key() -> None:
    """A known first key whose size does not fit the rest: pieces of its size straddle the
    others, the span read is not the list, and the header is decoded the usual way."""
    cache = KeyCache()
    decoded_keys(cache, LONG)
    other = [ObjectKey("another-model", 0, bytes([index]) * 20) for index in range(100)]
    shorter = [ObjectKey("m", 0, bytes([index]) * 4) for index in range(200)]
    for keys in (
        [LONG[0], *other],
        [LONG[0], *shorter],
        [*LONG[:50], *other[:50]],
        [LONG[0], *shorter[:50], *LONG],
    ):
        for request in keyed_requests(keys):
            header = p.encode(request)
            assert outcome(lambda data: decode_request(data, cache), header) == outcome(
                p.request_decoder.decode, header
            )


def test_long_headers_encoded_another_way_decode_as_with_the_full_decoder() -> None:
    """Request ids and tokens in every width msgpack has for them (and some a writer could
    use but this reader does not locate the list after), arrays of 16-bit length, a field
    this version does not know: the full decoder's request or error every time."""
    cache = KeyCache()
    decoded_keys(cache, LONG)
    keys = b"".join([b"\xdc", len(LONG).to_bytes(2, "big"), *(key.to_bytes() for key in LONG)])
    ids = [b"\x07", b"\xcc\x07", b"\xcd\x00\x07", b"\xce\x00\x00\x00\x07", b"\xcf" + (7).to_bytes(8, "big")]
    ids += [b"\xd0\x07", b"\xd3" + (7).to_bytes(8, "big"), b"\xcf" + (1 << 63).to_bytes(8, "big"), b"\xff"]
    tokens = [
        b"\xa3tok",
        b"\xd9\x03tok",
        b"\xda\x00\x03tok",
        b"\xdb\x00\x00\x00\x03tok",
        b"\xc4\x03tok",
        b"\xc0",
    ]
    tags = [b"\x03", b"\xcc\x03", b"\x0b", b"\x0c", b"\x02"]
    for lead in (b"\x94", b"\x95", b"\xdc\x00\x04", b"\xdc\x00\x05", b"\x96"):
        for tag in tags:
            for req_id in ids:
                for token in tokens:
                    header = lead + tag + req_id + token + keys + b"\xc2" + b"\x01"
                    expected = outcome(p.request_decoder.decode, header)
                    assert outcome(lambda data: decode_request(data, cache), header) == expected


def test_truncated_and_extended_long_headers_get_the_full_decoders_verdict() -> None:
    cache = KeyCache()
    decoded_keys(cache, LONG)
    for request in keyed_requests(LONG):
        header = p.encode(request)
        cuts = [*range(0, 12), *range(len(header) - 40, len(header) + 1)]
        cuts += [len(header) // 2, len(header) - len(LONG[0].to_bytes())]
        for data in [header[:cut] for cut in cuts] + [header + b"\x00", header + header[-5:]]:
            expected = outcome(p.request_decoder.decode, data)
            assert outcome(lambda raw: decode_request(raw, cache), data) == expected


def test_long_headers_with_fields_out_of_range_are_refused_with_the_full_decoders_error() -> None:
    cache = KeyCache()
    decoded_keys(cache, LONG)
    count = len(LONG)
    for request in (
        p.Lookup(1, "", LONG, p.MAX_WAIT_S * 2),
        p.StoreReserve(1, "", LONG, [0] * count),
        p.StoreReserve(1, "", LONG, [1] * count, ["x" * 300] * count),
        p.Retrieve(1, "t" * 300, LONG, True),
    ):
        header = p.encode(request)
        expected = outcome(p.request_decoder.decode, header)
        assert expected[0] == "ValidationError"
        assert outcome(lambda data: decode_request(data, cache), header) == expected


def test_mutated_long_headers_of_known_keys_get_the_full_decoders_verdict() -> None:
    """Byte flips anywhere, and in the fields around the key list in particular."""
    cache = KeyCache()
    decoded_keys(cache, SAME_SIZE[:200])
    seeds = [p.encode(request) for request in keyed_requests(SAME_SIZE[40:160])]
    seeds += [p.encode(p.Lookup(1, "", list(reversed(SAME_SIZE[:120]))))]
    check_mutations(random.Random(19), cache, seeds)
    rng = random.Random(20)
    for _ in range(3000):
        header = bytearray(rng.choice(seeds))
        position = rng.choice([rng.randrange(12), len(header) - 1 - rng.randrange(16)])
        header[position] = rng.randrange(256)
        data = bytes(header)
        assert outcome(lambda raw: decode_request(raw, cache), data) == outcome(
            p.request_decoder.decode, data
        )


def test_the_key_list_of_a_short_or_cut_header_is_not_located() -> None:
    """Any prefix of a header (each cut short in one of its first fields) gives no offset,
    or one inside it, and never reads past its end."""
    from lmcache_tiers.wire import decoding

    for header in (
        p.encode(p.Lookup(1 << 40, "t" * 40, LONG[:1])),
        b"\xdc\x00\x04\x03\xcf" + bytes(8) + b"\xda",
    ):
        for cut in range(len(header) + 1):
            at = decoding._key_list_offset(header[:cut], decoding._KEYS_FOURTH)
            assert at is None or at < cut


def test_compiled_piece_layouts_are_bounded_by_their_pieces() -> None:
    """A layout compiled to cut a list costs some 32 bytes a piece: lists of 8192 keys in
    many lengths would have kept 256 of them (64 MiB).  They stay within some 2 MiB, and
    lists still decode right once layouts were forgotten."""
    cache = KeyCache()
    keys = [ObjectKey("m", 0, index.to_bytes(4, "big")) for index in range(4500)]
    for count in range(4000, 4000 + 40):
        assert decoded_keys(cache, keys[:count], count) == keys[:count]
        assert sum(layout.__sizeof__() for layout in cache._splitters.values()) <= 3 << 20
    assert decoded_keys(cache, keys[5:4400]) == keys[5:4400]
