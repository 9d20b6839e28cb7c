"""The header of one slot: which device and slot it belongs to, which write produced it,
which key it holds, then core's record header (lengths, serde chain, payload checksum).

Layout (little-endian)::

    magic "LMTRSLOT" | device identity 16B | slot u64 | seq u64 | stored u64 | l1 u64
    | key_len u16 | 2 reserved | record_len u32 | crc32 u32 | key | record header

The crc covers everything but itself, key and record header included, so a torn or stale
header is recognised before any of its fields is trusted.  The identity (random, chosen
when the device was formatted) makes headers left by an earlier format -- or by another
device's image copied over this one -- never count as this device's objects; the slot
number makes a header read from the wrong place never count.  The key and both sizes
are repeated outside the record header so recovery can list an object whose record it
cannot decode with the configured serde chain (kept, as core asks) without guessing.

A slot header carries no format version of its own: the superblock's
(:data:`DEVICE_FORMAT_VERSION`) governs every slot header of its device (and every
``dax`` index entry, which holds one); checkpoints and records carry versions of their
own.  Any change of this layout bumps it, so a newer server's slot is never read
here as empty and overwritten as free: a device of a newer format is reformatted whole
at start-up (``device_formats``, with a warning naming the version), never read a slot
at a time.  ``tests/test_slots.py`` pins the encoding of this version.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final

import msgspec

from lmcache_tiers.plugin import KeyValidationError, ObjectKey

#: the format version of a whole slot device, written in its superblock; see above
DEVICE_FORMAT_VERSION: Final = 1
SLOT_MAGIC: Final = b"LMTRSLOT"
IDENTITY_BYTES: Final = 16
_FIELDS = struct.Struct(f"<8s{IDENTITY_BYTES}sQQQQHxxI")
_CRC = struct.Struct("<I")
#: bytes of the fixed part, before the key
FIXED_BYTES: Final = _FIELDS.size + _CRC.size


@dataclass(frozen=True)
class SlotHeader:
    """A decoded, crc-checked slot header."""

    slot: int
    seq: int
    key: ObjectKey
    stored: int
    l1: int
    record: bytes  # core's record header, verified separately by the caller


def encode_slot_header(
    identity: bytes, slot: int, seq: int, key: ObjectKey, stored: int, l1: int, record: bytes
) -> bytes:
    """The header of a slot about to hold ``key``'s payload."""
    key_bytes = key.to_bytes()
    fields = _FIELDS.pack(SLOT_MAGIC, identity, slot, seq, stored, l1, len(key_bytes), len(record))
    crc = zlib.crc32(record, zlib.crc32(key_bytes, zlib.crc32(fields)))
    return fields + _CRC.pack(crc) + key_bytes + record


def decode_slot_header(data: bytes | memoryview, identity: bytes, slot: int) -> SlotHeader | None:
    """The header in ``data`` if it is an intact header of ``slot`` on this device, else
    None (never written, left by an earlier format, torn, or damaged)."""
    view = memoryview(data).cast("B")
    if len(view) < FIXED_BYTES or bytes(view[:8]) != SLOT_MAGIC:
        return None
    _magic, owner, number, seq, stored, l1, key_len, record_len = _FIELDS.unpack_from(view)
    end = FIXED_BYTES + key_len + record_len
    if owner != identity or number != slot or end > len(view):
        return None
    (crc,) = _CRC.unpack_from(view, _FIELDS.size)
    key_bytes = view[FIXED_BYTES : FIXED_BYTES + key_len]
    record = view[FIXED_BYTES + key_len : end]
    if zlib.crc32(record, zlib.crc32(key_bytes, zlib.crc32(view[: _FIELDS.size]))) != crc:
        return None
    try:
        key = ObjectKey.from_bytes(bytes(key_bytes))
    except (KeyValidationError, msgspec.DecodeError):
        return None
    return SlotHeader(number, seq, key, stored, l1, bytes(record))


def record_of(data: bytes | memoryview, identity: bytes, slot: int, seq: int, key: ObjectKey) -> bytes | None:
    """The record header in ``data`` if it is the intact header of write ``seq`` of
    ``key`` in ``slot`` on this device, else None: what a load checks, without decoding
    the key (it compares the encoded bytes)."""
    view = memoryview(data).cast("B")
    if len(view) < FIXED_BYTES or bytes(view[:8]) != SLOT_MAGIC:
        return None
    _magic, owner, number, found_seq, _stored, _l1, key_len, record_len = _FIELDS.unpack_from(view)
    end = FIXED_BYTES + key_len + record_len
    if owner != identity or number != slot or found_seq != seq or end > len(view):
        return None
    (crc,) = _CRC.unpack_from(view, _FIELDS.size)
    key_bytes = view[FIXED_BYTES : FIXED_BYTES + key_len]
    record = view[FIXED_BYTES + key_len : end]
    if key_bytes != key.to_bytes():
        return None
    if zlib.crc32(record, zlib.crc32(key_bytes, zlib.crc32(view[: _FIELDS.size]))) != crc:
        return None
    # A copy: no view of a mapping outlives the call (it would keep the mapping alive).
    return bytes(record)
