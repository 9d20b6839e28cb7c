"""Decoding request headers, with the keys recognised by their bytes.

Building and validating one :class:`~lmcache_tiers.keys.ObjectKey` per key was most of the
cost of a LOOKUP with many keys, although a server sees the same keys over and over (an
engine stores a prompt, looks it up, retrieves it, releases it, and looks it up again for
the next request sharing the prefix).  :func:`decode_request` decodes the key list of
every request as the raw msgpack of each key and maps those bytes to the key decoded from
them before; a key not seen yet is decoded, and so validated, by ``ObjectKey`` itself, and
remembered.  Handing out the same key object each time also makes every dict the key
passes through (L1's table, the eviction policy, a client's lock records) match it by
identity instead of comparing fields.

The result is always what :data:`~lmcache_tiers.wire.protocol.request_decoder` returns for
the same header (equal keys, the same other fields), and a header it refuses is refused
with its very error: whatever the fast path does not accept -- a malformed key, a field out
of range -- is decoded again by that decoder, which raises.  Equal bytes decode to equal
keys, so a remembered key is one that passed validation when its bytes were first seen.

The key list is taken as one raw msgpack region.  When its keys all encode to the same
length -- the usual case: one model, one rank, one salt, hashes of one size -- the region
is cut into equal pieces by one ``struct`` unpack in C, with no per-key Python object but
the piece itself.  The cut is trusted only when every piece is the exact bytes of a key
validated before: a valid msgpack value is never a prefix of another, so pieces that are
each one whole value, laid end to end over the region, are exactly its elements.  Pieces
not known are decoded as keys from the pieces themselves (a new prompt's STORE), which
proves the cut the same way when each is one whole key; a piece that is not sends the
whole list down the per-element path (one ``msgspec.Raw`` per key, split by msgspec
itself).

Keys also remember where they were first seen: the key list they were decoded from (when
its keys all encode to one length), with their position in it -- every eighth new key of
a list (:data:`_ORIGIN_STRIDE`; remembering each was most of the cost of decoding a list
of new keys).  An engine looks up again the prompts it stored, and a prompt's chunks are
stored in order, so a new key list of :data:`_RUN_LOOKUP_MIN_KEYS` or more is most often
a run of a list seen before -- the keys a STORE named, from some position on.  The first
of its first eight keys that is remembered names that list and the run's position; one
comparison of the run's bytes with the remembered list's (a ``memcmp``, in place) then
gives the whole run, sliced from that list's keys, with no piece, hash or probe per key.
Equal bytes at equal piece boundaries are equal keys, for the reason above; a list that is
not such a run (or a few such runs) is cut into pieces as before.  The lists kept for this hold at most
:data:`_ORIGIN_BYTES_MAX` bytes in all; past that they are forgotten, and the keys first
seen in them are cut into pieces from then on.

A long header (:data:`_CUT_MIN_BYTES` and more) is not given to msgspec whole: walking its
key list to skip it costs msgspec tens of nanoseconds per key, more than the rest of a
LOOKUP of known keys.  The key list is located after the three fields before it (op tag,
request id, token, read as msgpack reads them; a header encoding them otherwise is decoded
whole), its first key is looked up among the known keys at the sizes lists were cut at
lately (or, when not known, decoded at them: a new prompt's list), and the list is taken to
end where that many keys of that size would.  The header with an empty list in its place
is decoded by msgspec -- every other field is checked as ever -- and the list is cut as
above.  Every piece of it being a whole key (known, or decoding with nothing left over)
proves that the list ends there, so the request is the one the full decoder gives;
anything else is decoded the usual way.

The cache holds at most :data:`KEY_CACHE_ENTRIES` keys and is emptied when full, so a
client sending ever new keys cannot grow it; past that it costs one decode per key, as
before.

Whole key lists are remembered as well: an engine asks about a waiting prompt at every
scheduler step, and retrieves what it found.  A list is found by its length and last bytes
and then compared whole (one ``memcmp``): equal bytes decode to equal keys, so the keys it
gave before are handed out again, in a list of the caller's own.  A list is kept only the
second time it is seen (the first time only its length and last bytes are noted): keeping
a copy of every list costs a lookup of a new prefix more than the repeats save.

A LOOKUP's list of new keys (:data:`_LAZY_MIN_KEYS` or more, its first key not known) is
not decoded key by key by a cache made with ``lazy_lookups`` (a server's without L2
adapters, or whose adapters all answer lookups at once): a new prompt misses at its first
key, and no other is looked at unless something needs them (a hit in L1 or L2; an L2
adapter answering only on its worker would need every one).  The list is
proven valid as a whole -- every piece equal to the first key's canonical encoding outside
the bytes of its chunk hash, so each is that key with another hash of the same length --
and handed out as a :class:`~lmcache_tiers.lazy_keys.LazyKeys`, which decodes them all
through this cache the first time anything but the first key is asked for.  It is
remembered as any list is, the second time it comes (a prompt waiting to be scheduled is
asked about at every step), as the ``LazyKeys`` itself -- nothing changes one --, which
LOOKUPs of that list are handed again; any other request naming it gets its keys decoded,
in a list of its own.  A list not proven valid so is decoded as above.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Annotated, Any, NamedTuple, Union, get_args

import msgspec
import numpy as np

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.lazy_keys import LazyKeys
from lmcache_tiers.wire import protocol as p

__all__ = ["KEY_CACHE_ENTRIES", "KeyCache", "decode_request"]

#: ~460 bytes each (the key object, its bytes, the dict entry; bench/bench_memory.py):
#: ~30 MiB when full, besides the whole lists and their origins (at most 24 MiB more) and
#: the layouts lists are cut with (2 MiB).
KEY_CACHE_ENTRIES = 1 << 16

_RawKeys = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=p.MAX_KEYS_PER_REQUEST)]
_raw_keys_decoder: msgspec.msgpack.Decoder[list[msgspec.Raw]] = msgspec.msgpack.Decoder(_RawKeys)
_KEY_ENCODER = msgspec.msgpack.Encoder().encode
#: compiled equal-piece layouts by (piece length, pieces); a few per client in practice
_SPLITTERS_MAX = 256
#: pieces those layouts may cut in all: each costs a ``struct`` code of some 32 bytes, and
#: 256 layouts of 8192 pieces would hold 64 MiB (this holds 2 MiB)
_SPLITTER_PIECES_MAX = 1 << 16


#: whole key lists remembered (a lookup of a waiting prompt repeats every scheduler step),
#: and the bytes of msgpack they may hold in all
_LISTS_MAX = 256
_LIST_BYTES_MAX = 8 << 20
#: a list is found by its length and its last bytes (its last key), then compared whole
_TAIL_BYTES = 48
_TAIL = struct.Struct(f"{_TAIL_BYTES}s")
#: lists seen once, noted by length and last bytes only: a list is kept when it comes again
#: before this many other new lists (so lists that return only after many others are never
#: copied just to be dropped before they come again)
_SIGHTED_MAX = _LISTS_MAX

#: key lists shorter than this are not remembered as places where keys were first seen
_RUN_MIN_KEYS = 8
#: bytes the remembered lists may hold in all (their msgpack and key lists); past that they
#: are forgotten.  A list stays while any key first seen in it is remembered, so a client
#: bringing one new key in each long list would otherwise keep every such list.
_ORIGIN_BYTES_MAX = 16 << 20
#: a key list is taken as runs of remembered lists in at most this many pieces, or not at all
_RUNS_MAX = 4
#: every this-many-th new key of a list is remembered as found there (each costs an entry in
#: a dict of up to some 250,000, most of the cost of decoding a list of new keys when every
#: one was); a run is found by the first of its first keys so remembered
_ORIGIN_STRIDE = 8
#: lists shorter than this are cut into pieces without looking for runs: as cheap for them
#: as the probes finding a run's remembered key (measured with 16 keys)
_RUN_LOOKUP_MIN_KEYS = 32
#: a LOOKUP's list of new keys this long or longer is handed out as a ``LazyKeys``: shorter
#: ones are decoded about as cheaply as the checks that prove them valid together (decoded
#: and deduplicated in process: 8 keys 8.0 us either way, 16 keys 8.8 us against 12.1)
_LAZY_MIN_KEYS = 16
#: a ``LazyKeys`` of this many keys or more is told whether they are distinct from the first
#: 8 bytes of their hashes (``_distinct_hash_prefixes``): hashing every key's encoding for a
#: set of them, as ``LazyKeys.all_distinct`` does, cost 20 us for 512 new keys against 9 us;
#: for 16 keys the set costs 1 us against numpy's 4 us of calls
_PREFIX_DISTINCT_MIN_KEYS = 128

_BYTE = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
#: widths of the length or value after a msgpack unsigned integer's and string's first byte
_UINT_WIDTHS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_STR_WIDTHS = {0xD9: 1, 0xDA: 2, 0xDB: 4}
#: key sizes a header's first key is tried at (keys of one client mostly share one), noted
#: from lists of at least _SIZE_NOTED_BYTES cut into equal pieces (shorter ones come in
#: headers too short to be cut)
_SIZES_MAX = 8
_SIZE_NOTED_BYTES = 1024


def _array_header(data: bytes, at: int, end: int) -> tuple[int, int] | None:
    """(elements, header length) of a msgpack array at ``at`` in ``data`` (which ends at
    ``end``), or None (read with ``struct``: cheaper than slicing a memoryview)."""
    if at >= end:
        return None
    (first,) = _BYTE.unpack_from(data, at)
    if 0x90 <= first <= 0x9F:  # fixarray
        return first & 0x0F, 1
    if first == 0xDC and end - at >= 3:  # array 16
        return _U16.unpack_from(data, at + 1)[0], 3
    if first == 0xDD and end - at >= 5:  # array 32
        return _U32.unpack_from(data, at + 1)[0], 5
    return None


def _key_list_offset(header: bytes, keyed_tags: frozenset[int]) -> int | None:
    """Where the key list of the request ``header`` starts: the fourth item of its array,
    after the op tag (one of ``keyed_tags``), the request id and the token, read as msgpack
    reads them.  None when one of them is encoded otherwise (msgspec decodes the header
    then): only the formats whose length the first byte and its length field give."""
    size = len(header)
    if size < 8:  # room for the array, tag and id heads read before any length check
        return None
    lead = header[0]
    if 0x90 <= lead <= 0x9F:  # fixarray
        at = 1
    elif lead == 0xDC:  # array 16
        at = 3
    else:
        return None
    if header[at] not in keyed_tags:  # positive fixints
        return None
    at += 1
    kind = header[at]  # the request id: a positive fixint or an unsigned integer
    if kind <= 0x7F:
        at += 1
    elif kind in _UINT_WIDTHS:
        at += 1 + _UINT_WIDTHS[kind]
    else:
        return None
    if at >= size:
        return None
    kind = header[at]  # the token: a string
    if 0xA0 <= kind <= 0xBF:  # fixstr
        at += 1 + (kind & 0x1F)
    elif kind in _STR_WIDTHS:
        width = _STR_WIDTHS[kind]
        at += 1 + width + int.from_bytes(header[at + 1 : at + 1 + width], "big")
    else:
        return None
    return at if at < size else None


class _SeenList(NamedTuple):
    """A key list whose keys all encode to one length, where some of them were decoded
    first: its msgpack elements (no array header, and a view of them, for comparisons
    without a copy) and its keys, in order."""

    elements: bytes
    view: memoryview
    keys: list[ObjectKey]


class KeyCache:
    """Validated keys by the bytes they were decoded from; one per decoding thread.

    ``lazy_lookups``: a LOOKUP's list of new keys may come as a :class:`LazyKeys`.  Only
    worth it where a miss at the first key looks at no other: a server with an L2 adapter
    that answers lookups only on its worker (``L2Adapter.answers_lookups_now`` False) asks
    it about every key L1 misses, and then proving the list valid as a whole costs on
    top of decoding it (a LOOKUP of 32 new keys decoded and deduplicated in process: 36 us
    instead of 26; of 512: 333 us instead of 268).
    """

    def __init__(self, entries: int = KEY_CACHE_ENTRIES, *, lazy_lookups: bool = True) -> None:
        self.entries = entries
        self.lazy_lookups = lazy_lookups
        self._keys: dict[bytes, ObjectKey] = {}
        self._decode = msgspec.msgpack.Decoder(ObjectKey).decode
        self._splitters: dict[tuple[int, int], struct.Struct] = {}
        self._splitter_pieces = 0
        # whole key lists seen before, by (length, last bytes): (their msgpack, keys)
        self._lists: dict[tuple[int, bytes], tuple[msgspec.Raw, list[ObjectKey] | LazyKeys]] = {}
        self._list_bytes = 0
        self._sighted: dict[tuple[int, bytes], None] = {}
        # where a key was decoded first: its list and its position there
        self._origins: dict[bytes, tuple[_SeenList, int]] = {}
        self._origin_bytes = 0
        # encoded sizes of keys in lists cut into equal pieces lately, most often one
        self._sizes: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def keys_in(self, raw: msgspec.Raw, lazy: bool = False) -> Sequence[ObjectKey]:
        """The keys of the msgpack array ``raw``; raises whatever decoding it as a list of
        keys raises.  ``lazy``: a list of new keys may come as a :class:`LazyKeys` (a
        LOOKUP's)."""
        total = len(raw)
        tag = (total, _TAIL.unpack_from(raw, total - _TAIL_BYTES)[0]) if total >= _TAIL_BYTES else None
        seen = self._lists.get(tag) if tag is not None else None
        if seen is not None and seen[0] == raw:  # one memcmp
            return _again(seen[1], lazy)
        keys = None
        shape = _array_header(raw, 0, total)
        if shape is not None:
            count, start = shape
            if 0 < count <= p.MAX_KEYS_PER_REQUEST and not (total - start) % count:
                size = (total - start) // count
                keys = self._equal_pieces(raw, start, count, size, lazy)
                if keys is not None and total >= _SIZE_NOTED_BYTES and size not in self._sizes:
                    self._note_size(size)  # so that the next such list is cut (_decode_cut)
        if keys is None:
            keys = self.keys_of(_raw_keys_decoder.decode(raw))
        if tag is not None:
            self._note_list(tag, raw, 0, keys)
        return keys

    def equal_span(self, header: bytes, at: int) -> tuple[int, int, int] | None:
        """(keys, where the first starts, its size) of the key list at ``at`` in ``header``
        when its first key is one seen before, or one that decodes whole, at one of the
        sizes keys were cut at lately; the list then ends where that many keys of that size
        do, if they all have it (:meth:`keys_at` tells).  Either way the first key's bytes
        are one whole msgpack value, and no value is a prefix of another, so at most one
        size fits."""
        shape = _array_header(header, at, len(header))
        if shape is None:
            return None
        count, length = shape
        if not 0 < count <= p.MAX_KEYS_PER_REQUEST:
            return None
        start = at + length
        known = self._keys
        for size in self._sizes:
            first = header[start : start + size]
            if first in known or self._is_key(first):
                return (count, start, size) if start + count * size <= len(header) else None
        return None

    def _is_key(self, data: bytes) -> bool:
        """Whether ``data`` is one whole valid key (the first key of a list never seen: a
        prompt looked up or stored for the first time)."""
        try:
            self._decode(data)
        except Exception:
            return False
        return True

    def keys_at(
        self, header: bytes, at: int, start: int, count: int, size: int, lazy: bool = False
    ) -> Sequence[ObjectKey] | None:
        """The ``count`` keys of the list at ``at`` in ``header``, when they are its
        ``count`` pieces of ``size`` bytes from ``start``, each a whole key (None
        otherwise: the list is not cut there, and nothing of it was taken); ``lazy`` as
        in :meth:`keys_in`."""
        end = start + count * size
        # (a list shorter than _TAIL_BYTES is never remembered: its tag matches none)
        tag = (end - at, header[end - _TAIL_BYTES : end])
        seen = self._lists.get(tag)
        if seen is not None and header.startswith(seen[0], at):  # one memcmp, both as long
            return _again(seen[1], lazy)
        keys = self._equal_pieces(header, start, count, size, lazy)
        if keys is not None:
            self._note_list(tag, header, at, keys)
        return keys

    def _note_list(
        self, tag: tuple[int, bytes], data: bytes | msgspec.Raw, at: int, keys: Sequence[ObjectKey]
    ) -> None:
        """Note the list ``tag`` names, at ``at`` in ``data`` (a header, or the list alone
        when ``at`` is 0); keep it the second time it comes soon."""
        total = tag[0]
        if total < _TAIL_BYTES or total > _LIST_BYTES_MAX // 4:
            return
        sighted = self._sighted
        if tag in sighted:
            del sighted[tag]
            self._remember_list(tag, msgspec.Raw(data[at : at + total] if at else bytes(data)), keys)
        else:
            if len(sighted) >= _SIGHTED_MAX:
                sighted.clear()
            sighted[tag] = None

    def _remember_list(self, tag: tuple[int, bytes], data: msgspec.Raw, keys: Sequence[ObjectKey]) -> None:
        lists = self._lists
        # A copy of the keys: the caller keeps its list.  A LazyKeys is kept itself: nothing
        # changes one, and a copy would decode it.
        kept = keys if type(keys) is LazyKeys else list(keys)
        if self._list_bytes + _held(data, kept) > _LIST_BYTES_MAX or len(lists) >= _LISTS_MAX:
            lists.clear()
            self._list_bytes = 0
        previous = lists.get(tag)
        if previous is not None:
            self._list_bytes -= _held(*previous)
        lists[tag] = (data, kept)
        self._list_bytes += _held(data, kept)

    def _note_size(self, size: int) -> None:
        sizes = self._sizes
        if size not in sizes:
            if len(sizes) >= _SIZES_MAX:
                sizes.clear()
            sizes[size] = None

    def _equal_pieces(
        self, data: bytes | msgspec.Raw, start: int, count: int, size: int, lazy: bool = False
    ) -> Sequence[ObjectKey] | None:
        """The ``count`` keys of ``size`` bytes each from ``start`` in ``data``, when every
        such piece is a whole key: one known, or one that decodes with nothing left over.
        ``lazy``: a list whose first key is new may come as a :class:`LazyKeys`."""
        if self._origins and count >= _RUN_LOOKUP_MIN_KEYS:
            runs = self._runs_of_seen_lists(bytes(data), start, size, count)
            if runs is not None:
                return runs
        pieces = self._splitter(size, count).unpack_from(data, start)
        if lazy and self.lazy_lookups and count >= _LAZY_MIN_KEYS and pieces[0] not in self._keys:
            deferred = self._lazy_keys(data, start, count, size, pieces)
            if deferred is not None:
                return deferred
        keys: list[Any] = list(map(self._keys.get, pieces))
        if not all(keys):  # keys are never false, None is
            # New keys: decoded from the pieces already cut, unless one is not a whole key
            # (keys of different lengths whose total happened to divide evenly), which
            # leaves the list to the per-element path.  Every piece decoding to a key with
            # nothing left over makes the cut exact, as every piece being a known key does.
            try:
                keys = self._with_new_keys(list(pieces), keys)
            except Exception:
                return None
        return keys

    def _splitter(self, size: int, count: int) -> struct.Struct:
        """The compiled layout of ``count`` pieces of ``size`` bytes; the layouts kept are
        forgotten when one more would pass their count or their budget of pieces."""
        splitters = self._splitters
        splitter = splitters.get((size, count))
        if splitter is None:
            if len(splitters) >= _SPLITTERS_MAX or self._splitter_pieces + count > _SPLITTER_PIECES_MAX:
                splitters.clear()
                self._splitter_pieces = 0
            splitter = splitters[(size, count)] = struct.Struct(f"{size}s" * count)
            self._splitter_pieces += count
        return splitter

    def _runs_of_seen_lists(self, data: bytes, start: int, size: int, count: int) -> list[ObjectKey] | None:
        """The ``count`` keys of ``size`` bytes each from ``start`` in ``data``, when they
        are at most ``_RUNS_MAX`` runs of lists whose keys were first decoded there."""
        origins = self._origins
        keys: list[ObjectKey] = []
        done = 0
        for _ in range(_RUNS_MAX):
            at = start + done * size
            for skipped in range(min(_ORIGIN_STRIDE, count - done)):
                found = at + skipped * size
                origin = origins.get(data[found : found + size])
                if origin is not None:
                    break
            else:
                return None
            # The key found encodes to exactly these ``size`` bytes, so its list's keys do
            # too; the run starts where that list has the keys ``skipped`` before it, if it does.
            seen, position = origin[0], origin[1] - skipped
            if position < 0:
                return None
            run = min(count - done, len(seen.keys) - position)
            # One memcmp, in place: equal bytes, cut at equal boundaries, are the same keys.
            if not data.startswith(seen.view[position * size : (position + run) * size], at):
                return None
            if run == count:  # one run, the usual case: one copy of the keys
                return seen.keys[position : position + run]
            keys += seen.keys[position : position + run]
            done += run
            if done == count:
                return keys
        return None

    def _lazy_keys(
        self, data: bytes | msgspec.Raw, start: int, count: int, size: int, pieces: Sequence[bytes]
    ) -> LazyKeys | None:
        """``pieces`` (the ``count`` pieces of ``size`` bytes from ``start`` in ``data``) as a
        :class:`LazyKeys`, when each is the first key's canonical encoding with other bytes
        in the chunk hash's place only, so that each is a valid key; None otherwise."""
        try:
            first = self._decode(pieces[0])
        except Exception:
            return None  # not a whole key: decoded the usual way, which says what is wrong
        # The encoding msgspec gives the first key (the client's, when it is one): then its
        # hash's bytes end where the encodings of the two fields after it begin.
        if first.to_bytes() != pieces[0]:
            return None
        end = size - len(_KEY_ENCODER(first.object_group)) - len(_KEY_ENCODER(first.cache_salt))
        begin = end - len(first.chunk_hash)
        if pieces[0][begin:end] != first.chunk_hash:
            return None
        rows = np.frombuffer(data, np.uint8, count * size, start).reshape(count, size)
        if not (rows[:, :begin] == rows[0, :begin]).all() or not (rows[:, end:] == rows[0, end:]).all():
            return None  # other names, ranks, groups or hash lengths among them
        distinct = None
        if count >= _PREFIX_DISTINCT_MIN_KEYS and end - begin >= 8 and _distinct_hash_prefixes(rows, begin):
            distinct = True
        return LazyKeys(pieces, first, self.keys_of, distinct=distinct)

    def keys_of(self, raws: Sequence[bytes | msgspec.Raw]) -> list[ObjectKey]:
        """The keys encoded in ``raws``; raises whatever decoding one of them raises."""
        encoded = list(map(bytes, raws))
        keys: list[Any] = list(map(self._keys.get, encoded))
        if all(keys):  # every key known (keys are never false, None is): the usual case
            return keys
        return self._with_new_keys(encoded, keys)

    def _with_new_keys(self, encoded: list[bytes], keys: list[Any]) -> list[ObjectKey]:
        """``keys`` (the known keys of ``encoded``, None for the others) with the others
        decoded and remembered; raises whatever decoding one of them raises."""
        cache = self._keys
        if len(cache) + len(encoded) > self.entries:
            cache.clear()
            # Remembered lists hold keys of the old cache: equal, but no longer the very
            # objects the rest of the server holds.
            self._lists.clear()
            self._list_bytes = 0
            self._sighted.clear()
            self._origins.clear()
            self._origin_bytes = 0
            # This list's known keys stay known, as the objects handed out with it.
            cache.update((data, key) for data, key in zip(encoded, keys, strict=True) if key is not None)
        decode = self._decode
        new: Sequence[int]
        if any(keys):
            new = []
            for position, key in enumerate(keys):
                if key is None:
                    data = encoded[position]
                    key = keys[position] = decode(data)
                    cache[data] = key
                    new.append(position)
        else:
            # Every key new (a prompt never seen): decoded and remembered in C-level passes,
            # with no Python step per key but ObjectKey's own validation.  A piece repeated
            # in the list is decoded each time, as above, and remembered as the last one.
            keys = list(map(decode, encoded))
            cache.update(zip(encoded, keys, strict=True))
            new = range(len(keys))
        self._remember_origins(encoded, keys, new)
        return keys

    def _remember_origins(self, encoded: list[bytes], keys: list[ObjectKey], new: Sequence[int]) -> None:
        """Note the list the keys at ``new`` were first decoded from (``encoded``: its
        elements), when its keys all encode to one length (positions are then offsets)."""
        if len(encoded) < _RUN_MIN_KEYS or len(set(map(len, encoded))) != 1:
            return
        elements = b"".join(encoded)
        seen = _SeenList(elements, memoryview(elements), list(keys))  # the caller keeps ``keys``
        held = len(seen.elements) + 8 * len(keys)
        if self._origin_bytes + held > _ORIGIN_BYTES_MAX:
            self._origins.clear()  # keys seen before then are cut into pieces, as before
            self._origin_bytes = 0
        self._origin_bytes += held
        origins = self._origins
        for position in new[::_ORIGIN_STRIDE]:
            origins[encoded[position]] = (seen, position)


def _distinct_hash_prefixes(rows: Any, begin: int) -> bool:
    """Whether the 8 bytes at ``begin`` of the rows of ``rows`` (one key's encoding each,
    the same but in the hash starting there) all differ: then so do the keys.  False says
    nothing (hashes may differ past their first 8 bytes)."""
    prefixes = np.ascontiguousarray(rows[:, begin : begin + 8]).view(np.uint64).ravel()
    prefixes.sort()
    return not bool((prefixes[1:] == prefixes[:-1]).any())


def _again(kept: list[ObjectKey] | LazyKeys, lazy: bool) -> Sequence[ObjectKey]:
    """The keys of a remembered list, handed out again: in a list of the caller's own, or
    to a LOOKUP (``lazy``) as the very ``LazyKeys`` that was kept, which nothing changes.
    A prompt waiting to be scheduled is asked about at every step: proving its new keys
    valid again each time cost 11-40 us (32-512 keys), against 2-5 us for a list kept."""
    if lazy and type(kept) is LazyKeys:
        return kept
    return list(kept)  # (a LazyKeys is decoded here, once: it keeps its keys then)


def _held(data: msgspec.Raw, kept: list[ObjectKey] | LazyKeys) -> int:
    """Bytes a remembered list is counted for: its msgpack, twice for a ``LazyKeys`` (which
    keeps its keys' encodings as pieces of their own)."""
    return 2 * len(data) if type(kept) is LazyKeys else len(data)


def _twin(kind: type[p._Request]) -> type[p._Request]:
    """``kind`` with its ``keys`` left as the raw msgpack of the key list; every other field
    is declared exactly as in protocol.py, so the twin accepts what ``kind`` accepts (the
    key list itself is checked by ``KeyCache.keys_in``)."""
    fields: list[tuple[str, Any, Any]] = []
    for field in msgspec.structs.fields(kind)[2:]:  # req_id and token come from _Request
        annotation = msgspec.Raw if field.name == "keys" else field.type
        if field.default_factory is not msgspec.NODEFAULT:
            fields.append((field.name, annotation, msgspec.field(default_factory=field.default_factory)))
        elif field.default is not msgspec.NODEFAULT:
            fields.append((field.name, annotation, field.default))
        else:
            fields.append((field.name, annotation))  # type: ignore[arg-type]
    return msgspec.defstruct(  # type: ignore[return-value]
        f"Raw{kind.__name__}", fields, bases=(p._Request,), tag=kind.__struct_config__.tag
    )


#: every request kind that names keys, by its twin, with the position of its keys
_REAL: dict[type[p._Request], tuple[type[p._Request], int]] = {
    _twin(kind): (kind, kind.__struct_fields__.index("keys"))
    for kind in get_args(p.Request)
    if "keys" in kind.__struct_fields__
}
_OTHERS = tuple(kind for kind in get_args(p.Request) if "keys" not in kind.__struct_fields__)
_fast_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    Union[tuple(_REAL) + _OTHERS]  # type: ignore[valid-type]
)
#: op tags of the requests whose keys come right after the token (the array's fourth item)
_KEYS_FOURTH: frozenset[int] = frozenset(
    tag
    for real, position in _REAL.values()
    if position == 2 and isinstance(tag := real.__struct_config__.tag, int)
)
#: what a header's key list is replaced with for decoding the rest: an empty array
_EMPTY_LIST = b"\x90"
_EMPTY_RAW = msgspec.Raw(_EMPTY_LIST)
#: headers shorter than this are decoded by msgspec whole: locating the key list and
#: decoding the rest apart costs about what msgspec's walk over some 35 keys does
#: (measured: 0.7 us more for 16 keys, 9 us less for 512)
_CUT_MIN_BYTES = 2048


def decode_request(header: bytes, cache: KeyCache) -> p._Request:
    """``protocol.request_decoder.decode(header)``, with the keys from ``cache``; a
    LOOKUP's list of new keys may be a :class:`~lmcache_tiers.lazy_keys.LazyKeys`."""
    if len(header) >= _CUT_MIN_BYTES:
        request = _decode_cut(header, cache)
        if request is not None:
            return request
    try:
        request = _fast_decoder.decode(header)
        twin_of = _REAL.get(type(request))
        if twin_of is None:
            return request  # type: ignore[no-any-return]
        keys = cache.keys_in(request.keys, twin_of[0] is p.Lookup)
    except Exception:  # the full decoder says what is wrong, in its own words
        return p.request_decoder.decode(header)
    kind, position = twin_of  # as in _real, inline: most headers are short
    values = list(msgspec.structs.astuple(request))
    values[position] = keys
    return kind(*values)


def _decode_cut(header: bytes, cache: KeyCache) -> p._Request | None:
    """The request, when its key list is found without msgspec walking it (which costs
    tens of nanoseconds per key): the list is located after the three fields before it,
    taken to end where its keys would if all were of its first key's size, and the header
    with an empty list in its place is decoded -- every other field checked as ever.  The
    keys are then the equal pieces of that span, each proven a whole key (known, or
    decoding with nothing left over), so the span is exactly the list and the request is
    the one the full decoder gives.  None for anything else (decoded the usual way)."""
    at = _key_list_offset(header, _KEYS_FOURTH)
    if at is None:
        return None
    span = cache.equal_span(header, at)
    if span is None:
        return None
    count, start, size = span
    try:
        request = _fast_decoder.decode(header[:at] + _EMPTY_LIST + header[start + count * size :])
    except Exception:
        return None
    twin_of = _REAL.get(type(request))
    if twin_of is None or twin_of[1] != 2 or request.keys != _EMPTY_RAW:
        return None  # the list was not where this read it: decoded the usual way
    keys = cache.keys_at(header, at, start, count, size, twin_of[0] is p.Lookup)
    if keys is None:
        return None
    return _real(request, twin_of, keys)


def _real(request: Any, twin_of: tuple[type[p._Request], int], keys: Sequence[ObjectKey]) -> p._Request:
    """The request of ``twin_of``'s kind that ``request`` (its twin) is, with ``keys``."""
    kind, position = twin_of
    values = list(msgspec.structs.astuple(request))
    values[position] = keys
    return kind(*values)
