"""Differential fuzzing of decode_request against protocol.request_decoder.

decode_request cuts key lists by their bytes (equal pieces, runs of remembered lists, whole
remembered lists, long headers' lists located without msgspec walking them).  A list that
came out different in any way -- a key shifted, merged or split, another count, a trailing
field taken as a key -- would hand a client another key's bytes.  So every header here, of
every request kind, with key lists built to trip those paths (keys of mixed sizes, repeated
keys, hashes that are prefixes of others or full of msgpack markers, equal keys encoded in
other widths, windows and splices of lists sent before, fields after the list that look
like keys) and mutated copies of it (truncated, bytes flipped, extended, an element cut
out), must decode to exactly what the full decoder gives, or fail with its very error --
through one KeyCache that remembers everything the session sent before.

``LMCACHE_TIERS_FUZZ_EXAMPLES`` raises the number of sessions for a longer run.
"""

from __future__ import annotations

import os
import random
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.lazy_keys import LazyKeys
from lmcache_tiers.wire import decoding
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.decoding import KeyCache, decode_request

EXAMPLES = int(os.environ.get("LMCACHE_TIERS_FUZZ_EXAMPLES", "100"))
#: bytes that mean something to msgpack as a first byte: arrays, strings, bins, nil, ints
MARKERS = bytes([0x90, 0x91, 0x93, 0x95, 0x9F, 0xDC, 0xDD, 0xC4, 0xC5, 0xA0, 0xA5, 0xD9, 0xDA, 0xC0, 0xC2])
MARKERS += bytes([0xC3, 0xCC, 0xCD, 0xCE, 0xCF, 0x00, 0x03, 0x7F, 0xFF, 0xE0])
KEYED = [p.Op.LOOKUP, p.Op.STORE_RESERVE, p.Op.STORE_COMMIT, p.Op.STORE_ABORT, p.Op.STORE_INLINE]
KEYED += [p.Op.RETRIEVE, p.Op.RELEASE, p.Op.EVICT]
COUNTS = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40, 63, 64, 65, 100, 120, 200, 511, 512, 513]
COUNTS += [70, 90, 150, 256, 300, 400, 511, 512, 513]  # headers of 2 KiB and more, most often
RARE_COUNTS = [p.MAX_KEYS_PER_REQUEST, p.MAX_KEYS_PER_REQUEST + 1, 10_000]


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def hash_bytes(rng: random.Random, length: int) -> bytes:
    """Random bytes, about half of them msgpack markers."""
    return bytes(rng.choice(MARKERS) if rng.random() < 0.5 else rng.randrange(256) for _ in range(length))


def uint(value: int, width: int) -> bytes:
    """``value`` as a msgpack unsigned integer of ``width`` bytes (0: a positive fixint)."""
    if width == 0:
        return bytes([value])
    head = {1: 0xCC, 2: 0xCD, 4: 0xCE, 8: 0xCF}[width]
    return bytes([head]) + value.to_bytes(width, "big")


def text(value: bytes, form: str) -> bytes:
    """``value`` as a msgpack string in ``form`` (fixstr, str8, str16, str32)."""
    length = len(value)
    if form == "fixstr" and length < 32:
        return bytes([0xA0 | length]) + value
    if form in ("fixstr", "str8") and length < 256:
        return b"\xd9" + bytes([length]) + value
    if form == "str32":
        return b"\xdb" + length.to_bytes(4, "big") + value
    return b"\xda" + length.to_bytes(2, "big") + value


def array_head(count: int, form: str) -> bytes:
    if form == "fix" and count < 16:
        return bytes([0x90 | count])
    if form == "32":
        return b"\xdd" + count.to_bytes(4, "big")
    return b"\xdc" + count.to_bytes(2, "big")


def other_encoding(rng: random.Random, key: ObjectKey) -> bytes:
    """``key`` encoded as another writer might: wider integers and strings, defaults left
    out or a field this version does not know after them.  Decodes to an equal key."""
    fields = [
        text(key.model_name.encode(), rng.choice(["fixstr", "str8", "str16"])),
        uint(key.kv_rank, rng.choice([0, 1, 2, 4, 8]) if key.kv_rank < 128 else 4),
        pack(key.chunk_hash),
    ]
    tail = [
        uint(key.object_group, rng.choice([0, 2]) if key.object_group < 128 else 2),
        text(key.cache_salt.encode(), "fixstr"),
    ]
    shape = rng.choice(["short", "full", "extra"])
    if shape == "short" and key.object_group == 0 and key.cache_salt == "":
        items = fields
    elif shape == "extra":
        items = [*fields, *tail, pack(rng.choice(["new", 7, None, [1, 2]]))]
    else:
        items = [*fields, *tail]
    return array_head(len(items), "fix") + b"".join(items)


def invalid_element(rng: random.Random) -> bytes:
    """A list element that is not a valid key (a whole msgpack value, or a broken one)."""
    return rng.choice(
        [
            pack(["", 0, b"\x01"]),
            pack(["a@b", 0, b"\x01" * 16]),
            pack(["model", -1, b"\x01" * 16]),
            pack(["model", 0, b""]),
            pack(["model", 0, b"\x01" * 65]),
            pack(["model", 0, b"\x01" * 16, 1 << 16, "salt"]),
            pack(["model", 0, b"\x01" * 16, 0, "a/b"]),
            pack(["model", 0, "not bytes"]),
            pack(["model", 0]),
            b"\x90",
            b"\xc0",
            b"\x07",
            pack("a string of some length"),
            b"\x95\xa5model",  # cut short
        ]
    )


class Session:
    """One client's requests through one KeyCache, with the key lists it sent before."""

    ops = KEYED

    def __init__(self, rng: random.Random, cache: KeyCache) -> None:
        self.rng = rng
        self.cache = cache
        self.sent: list[list[bytes]] = []
        self.families = [self._family() for _ in range(rng.randint(2, 4))]
        self.checked = 0
        self.lazy = 0  # LOOKUPs whose new keys came out undecoded (compared decoded)

    def _family(self) -> list[bytes]:
        """Keys of one shape: one model, salt, rank and hash length (so one encoded size,
        in the usual case), some encoded otherwise, some hashes prefixes of others."""
        rng = self.rng
        model = rng.choice(["model", "m", "meta-llama/Llama-3.1-8B", "x" * rng.randint(1, 60)])
        salt = rng.choice(["", "salt", "s" * rng.randint(1, 40)])
        rank = rng.choice([0, 7, 1 << 16 | 1, (1 << 32) - 1])
        group = rng.choice([0, 0, 2, 300])
        length = rng.choice([1, 2, 10, 11, 12, 16, 31, 32, 33, 64])
        # most families are of one encoded size, as one engine's keys are; the others mix
        mixed = rng.random() < 0.3
        keys: list[bytes] = []
        for _ in range(rng.randint(40, 700)):
            chunk_hash = hash_bytes(rng, length)
            if mixed and keys and rng.random() < 0.05 and length > 1:
                chunk_hash = chunk_hash[: rng.randint(1, length - 1)]  # another size
            key = ObjectKey(model, rank, chunk_hash, group, salt)
            keys.append(other_encoding(rng, key) if mixed and rng.random() < 0.03 else key.to_bytes())
            if mixed and rng.random() < 0.02:
                prefix = ObjectKey(model, rank, chunk_hash[:-1] or b"\x00", group, salt)
                keys.append(prefix.to_bytes())
        return keys

    def key_list(self) -> list[bytes]:
        rng = self.rng
        if self.sent and rng.random() < 0.65:
            elements = self._from_sent()
        else:
            family = rng.choice(self.families)
            count = rng.choice(RARE_COUNTS) if rng.random() < 0.01 else rng.choice(COUNTS)
            if count <= len(family) and rng.random() < 0.7:
                start = rng.randrange(len(family) - count + 1)
                elements = family[start : start + count]
            else:
                elements = [rng.choice(family) for _ in range(count)]
        return self._touched(elements)

    def _from_sent(self) -> list[bytes]:
        """A list like those sent before: again, a window, windows of several end to end,
        reversed, or one key over and over."""
        rng = self.rng
        source = rng.choice(self.sent[-12:])
        way = rng.random()
        if way < 0.25 or not source:
            return list(source)
        if way < 0.7:
            start = rng.randrange(len(source))
            return source[start : start + rng.randint(1, len(source))]
        if way < 0.9:
            elements: list[bytes] = []
            for _ in range(rng.randint(2, 6)):
                piece = rng.choice(self.sent[-12:])
                if piece:
                    start = rng.randrange(len(piece))
                    elements += piece[start : start + rng.randint(1, 80)]
            return elements
        if way < 0.95:
            return list(reversed(source))
        return [rng.choice(source)] * rng.choice([8, 32, 33, 200])

    def _touched(self, elements: list[bytes]) -> list[bytes]:
        """Now and then a key of another family or size, or an invalid element, put in,
        swapped in or taken out."""
        rng = self.rng
        elements = list(elements)
        for _ in range(rng.choice([0, 0, 0, 0, 0, 0, 1, 2])):
            position = rng.randint(0, len(elements))
            if rng.random() < 0.1:
                replacement = invalid_element(rng)
            else:
                replacement = rng.choice(rng.choice(self.families))
            kind = rng.random()
            if kind < 0.4 or not elements:
                elements.insert(position, replacement)
            elif kind < 0.8:
                elements[min(position, len(elements) - 1)] = replacement
            else:
                del elements[min(position, len(elements) - 1)]
        return elements

    def header(self, elements: list[bytes]) -> bytes:
        """A request of a random kind: of a keyed kind (in any of msgpack's forms of its
        first fields, with fields after the list that may look like keys), now and then
        one naming no keys."""
        rng = self.rng
        if rng.random() < 0.04:
            return p.encode(
                rng.choice(
                    [p.Ping(1, ""), p.Status(2, "t"), p.Clear(3, "", True), p.QueryPrefetchStatus(4, "", 5)]
                )
            )
        op = rng.choice(self.ops)
        count = len(elements)
        declared = count
        if rng.random() < 0.02:
            declared = max(0, count + rng.choice([-1, 1]))
        form = "fix" if declared < 16 and rng.random() < 0.8 else rng.choice(["16", "16", "16", "32"])
        items = [
            uint(op.value, 0) if rng.random() < 0.97 else uint(op.value, 1),
            self._request_id(),
            self._token(),
            array_head(declared, form) + b"".join(elements),
            *self._after(op, count, elements),
        ]
        lead = array_head(len(items), "fix" if rng.random() < 0.85 else rng.choice(["16", "32"]))
        return lead + b"".join(items)

    def _request_id(self) -> bytes:
        rng = self.rng
        value = rng.choice([0, 1, 5, 127, 128, 255, 256, 65535, 1 << 31, 1 << 40, (1 << 63) - 1])
        widths = [width for width in (0, 1, 2, 4, 8) if value < (128 if width == 0 else 1 << (8 * width))]
        if rng.random() < 0.02:
            return rng.choice([b"\xd0\x07", b"\xcf" + (1 << 63).to_bytes(8, "big"), b"\xc0", b"\xff"])
        return uint(value, rng.choice(widths))

    def _token(self) -> bytes:
        rng = self.rng
        value = rng.choice([b"", b"tok", b"t" * 31, b"t" * 32, b"t" * 256, b"t" * 257, hash_bytes(rng, 5)])
        if rng.random() < 0.02:
            return rng.choice([b"\xc4\x03tok", b"\xc0", b"\x05"])
        try:
            value.decode()
        except UnicodeDecodeError:
            value = b"\\x" + value.hex().encode()
        return text(value, rng.choice(["fixstr", "str8", "str16", "str32"]))

    def _after(self, op: p.Op, count: int, elements: list[bytes]) -> list[bytes]:
        """The fields after the key list: right, out of range, absent, or followed by fields
        this version does not know -- keys, the list itself again, an empty array."""
        rng = self.rng
        layouts = pack(rng.choice([[], ["uint8[4096]"] * count, [""] * count, ["x" * 300]]))
        flag = rng.choice([b"\xc2", b"\xc3"])
        fields = {
            p.Op.LOOKUP: [pack(rng.choice([0.0, 2.5, 0, 3600, 3600.5, -1.0]))],
            p.Op.STORE_RESERVE: [pack(rng.choice([[4096] * count, [1] * count, [0], []])), layouts],
            p.Op.STORE_COMMIT: [flag],
            p.Op.STORE_ABORT: [],
            p.Op.STORE_INLINE: [layouts, flag],
            p.Op.RETRIEVE: [flag, layouts],
            p.Op.RELEASE: [flag],
            p.Op.EVICT: [],
        }[op]
        if rng.random() < 0.3:
            fields = fields[: rng.randint(0, len(fields))]
            if op is p.Op.STORE_RESERVE and not fields:
                fields = [pack([1] * count)]
        if rng.random() < 0.15:  # fields after these (or in place of those left out)
            key_like = [b"\x90", b"\xc0", pack(7)]
            if elements:
                key_like += [rng.choice(elements), array_head(len(elements), "16") + b"".join(elements)]
            fields = [*fields, *(rng.choice(key_like) for _ in range(rng.randint(1, 2)))]
        return fields

    def check(self, header: bytes) -> None:
        expected = outcome(p.request_decoder.decode, header)
        got = outcome(lambda data: decode_request(data, self.cache), header)
        assert got == expected, header.hex()
        if expected[0] == "ok":
            assert type(got[1]) is type(expected[1])
            if isinstance(getattr(got[1], "keys", None), LazyKeys):
                assert isinstance(got[1], p.Lookup), "only a LOOKUP's keys are left undecoded"
                self.lazy += 1
        self.checked += 1

    def mutations(self, header: bytes) -> list[bytes]:
        """Copies of ``header`` cut short, with bytes flipped (often around the key list's
        ends), extended, or with part of it taken out."""
        rng = self.rng
        size = len(header)
        copies = []
        for _ in range(rng.randint(1, 3)):
            way = rng.random()
            if way < 0.3 and size:
                copies.append(header[: rng.randrange(size)])
            elif way < 0.6 and size:
                data = bytearray(header)
                for _ in range(rng.randint(1, 3)):
                    where = rng.choice(
                        [
                            rng.randrange(size),
                            rng.randrange(min(size, 16)),
                            size - 1 - rng.randrange(min(size, 48)),
                        ]
                    )
                    data[where] = rng.choice([rng.randrange(256), rng.choice(MARKERS), data[where] ^ 1])
                copies.append(bytes(data))
            elif way < 0.8:
                copies.append(
                    header
                    + rng.choice(
                        [b"\x00", b"\x90", b"\xc0", hash_bytes(rng, rng.randint(1, 40)), header[-20:]]
                    )
                )
            elif size > 8:
                start = rng.randrange(size - 1)
                copies.append(header[:start] + header[start + rng.randint(1, min(64, size - start)) :])
        return copies

    def run(self, requests: int) -> None:
        for _ in range(requests):
            elements = self.key_list()
            header = self.header(elements)
            self.check(header)
            for mutated in self.mutations(header) if self.rng.random() < 0.5 else []:
                self.check(mutated)
            if self.rng.random() < 0.3:
                self.check(header)  # again: now remembered (a list is kept the second time)
            if elements and len(elements) <= p.MAX_KEYS_PER_REQUEST:
                self.sent.append(elements)


def outcome(decode: Any, header: bytes) -> tuple[str, Any]:
    try:
        return "ok", decode(header)
    except Exception as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(seed=st.integers(0, 2**64 - 1), entries=st.sampled_from([decoding.KEY_CACHE_ENTRIES, 600, 64]))
def test_decode_request_matches_the_full_decoder_on_random_sessions(seed: int, entries: int) -> None:
    session = Session(random.Random(seed), KeyCache(entries=entries))
    session.run(40)
    assert session.checked >= 40


class NewPromptSession(Session):
    """LOOKUPs of keys never sent before (a new prompt), now and then with a key of another
    family or an invalid one put in, and mutated: the lists ``decode_request`` hands out
    undecoded (``LazyKeys``) and the ones it must not."""

    ops = [p.Op.LOOKUP] * 8 + KEYED  # other kinds now and then: lists remembered undecoded

    def key_list(self) -> list[bytes]:
        rng = self.rng
        if self.sent and rng.random() < 0.35:  # a list sent before, as it was
            return list(rng.choice(self.sent[-6:]))
        family = self._family()
        self.families[rng.randrange(len(self.families))] = family  # others' keys to put in
        count = min(len(family), rng.choice([32, 33, 40, 64, 100, 300, 512]))
        start = rng.randrange(len(family) - count + 1)
        return self._touched(family[start : start + count])


@settings(
    max_examples=max(EXAMPLES // 2, 10),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(seed=st.integers(0, 2**64 - 1))
def test_lookups_of_new_keys_match_the_full_decoder(seed: int) -> None:
    session = NewPromptSession(random.Random(seed), KeyCache())
    session.run(20)


def test_new_prompt_sessions_take_the_lazy_path() -> None:
    """The sessions above do hand out LazyKeys (those of these seeds, at least)."""
    sessions = [NewPromptSession(random.Random(seed), KeyCache()) for seed in range(6)]
    for session in sessions:
        session.run(20)
    assert sum(session.lazy for session in sessions) >= 10


@settings(
    max_examples=max(EXAMPLES // 3, 10),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(seed=st.integers(0, 2**64 - 1))
def test_decode_request_matches_the_full_decoder_with_origins_forgotten_often(seed: int) -> None:
    """Remembered origin lists past a tiny byte budget: forgotten every few lists."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoding, "_ORIGIN_BYTES_MAX", 8 << 10)
        session = Session(random.Random(seed), KeyCache())
        session.run(40)


def test_keys_encoded_otherwise_are_read_as_the_same_key() -> None:
    """The helper above encodes what the full decoder reads as the same key."""
    rng = random.Random(5)
    key = ObjectKey("meta-llama/Llama-3.1-8B", 7, hash_bytes(rng, 16), 2, "salt")
    for _ in range(50):
        assert p.request_decoder.decode(b"\x94\x03\x01\xa0\x91" + other_encoding(rng, key)) == p.Lookup(
            1, "", [key]
        )
