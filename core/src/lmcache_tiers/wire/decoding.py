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

The cache holds at most :data:`KEY_CACHE_ENTRIES` keys and is emptied when full, so a
client sending ever new keys cannot grow it; past that it costs one decode per key, as
before.
"""

from __future__ import annotations

from typing import Annotated, Any, Union, get_args

import msgspec

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p

__all__ = ["KEY_CACHE_ENTRIES", "KeyCache", "decode_request"]

#: ~300 bytes each (key, its bytes, the dict entry): ~20 MiB when full.
KEY_CACHE_ENTRIES = 1 << 16

_RawKeys = Annotated[list[msgspec.Raw], msgspec.Meta(max_length=p.MAX_KEYS_PER_REQUEST)]


class KeyCache:
    """Validated keys by the bytes they were decoded from; one per decoding thread."""

    def __init__(self, entries: int = KEY_CACHE_ENTRIES) -> None:
        self.entries = entries
        self._keys: dict[bytes, ObjectKey] = {}
        self._decode = msgspec.msgpack.Decoder(ObjectKey).decode

    def __len__(self) -> int:
        return len(self._keys)

    def keys_of(self, raws: list[msgspec.Raw]) -> list[ObjectKey]:
        """The keys encoded in ``raws``; raises whatever decoding one of them raises."""
        cache = self._keys
        encoded = list(map(bytes, raws))
        keys: list[Any] = list(map(cache.get, encoded))
        if all(keys):  # every key known (keys are never false, None is): the usual case
            return keys
        if len(cache) + len(encoded) > self.entries:
            cache.clear()
        decode = self._decode
        for position, key in enumerate(keys):
            if key is None:
                data = encoded[position]
                key = keys[position] = decode(data)
                cache[data] = key
        return keys


def _twin(kind: type[p._Request]) -> type[p._Request]:
    """``kind`` with its ``keys`` left as the raw msgpack of each key; every other field is
    declared exactly as in protocol.py, so the twin accepts what ``kind`` accepts."""
    fields: list[tuple[str, Any, Any]] = []
    for field in msgspec.structs.fields(kind)[2:]:  # req_id and token come from _Request
        annotation = _RawKeys if field.name == "keys" else field.type
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


def decode_request(header: bytes, cache: KeyCache) -> p._Request:
    """``protocol.request_decoder.decode(header)``, with the keys from ``cache``."""
    try:
        request = _fast_decoder.decode(header)
        twin_of = _REAL.get(type(request))
        if twin_of is None:
            return request  # type: ignore[no-any-return]
        keys = cache.keys_of(request.keys)
    except Exception:  # the full decoder says what is wrong, in its own words
        return p.request_decoder.decode(header)
    kind, position = twin_of
    values = list(msgspec.structs.astuple(request))
    values[position] = keys
    return kind(*values)
