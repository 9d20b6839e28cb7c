"""The first block of a slot device: what kind of store it is, its identity and geometry.

Layout: magic (8 bytes, one per adapter type) | version u32 | body_len u32 | crc32 u32 |
msgpack body ``{"identity": 16 bytes, "geometry": {name: int}, "formatted_at": float}``.

A device whose superblock is intact and whose geometry is the configured one is reopened
with its contents; any other of ours is reformatted (its objects dropped -- a miss is
safe).  A device is never formatted when it looks like something else:
:func:`foreign_signature` recognises the other slot store's superblock, partition tables
and the common filesystems, so a mistyped ``device_path`` never wipes a disk in use or
another adapter's objects.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import msgspec

from lmcache_plugin_raw_block.slotheader import DEVICE_FORMAT_VERSION, IDENTITY_BYTES

#: the format of the slot headers (they have no version field; checkpoints and records
#: have their own): a device of a newer one is reformatted, never read a slot at a time
SUPERBLOCK_VERSION: Final = DEVICE_FORMAT_VERSION
#: superblock magics of the two slot stores
RAW_BLOCK_MAGIC: Final = b"LMTRBLK1"
DAX_MAGIC: Final = b"LMTRDAX1"
#: what starts every lmcache-tiers format (superblocks, core's record files)
_TIERS_PREFIX: Final = b"LMTR"
_FIXED = struct.Struct("<8sIII")
#: bytes read to look for foreign signatures (btrfs keeps its magic at 64 KiB + 64)
SIGNATURE_PROBE_BYTES: Final = 68 << 10


class _Body(msgspec.Struct, frozen=True):
    identity: bytes
    geometry: dict[str, int]
    formatted_at: float


@dataclass(frozen=True)
class Superblock:
    identity: bytes
    geometry: dict[str, int]
    formatted_at: float


def new_identity() -> bytes:
    return os.urandom(IDENTITY_BYTES)


def encode_superblock(magic: bytes, identity: bytes, geometry: Mapping[str, int]) -> bytes:
    body = msgspec.msgpack.encode(_Body(identity, dict(geometry), time.time()))
    return _FIXED.pack(magic, SUPERBLOCK_VERSION, len(body), zlib.crc32(body)) + body


def decode_superblock(data: bytes | memoryview, magic: bytes) -> Superblock | None:
    """The superblock in ``data``, or None if there is no intact one with ``magic``."""
    view = memoryview(data).cast("B")
    if len(view) < _FIXED.size:
        return None
    found, version, length, crc = _FIXED.unpack_from(view)
    body = view[_FIXED.size : _FIXED.size + length]
    if found != magic or version != SUPERBLOCK_VERSION or len(body) != length or zlib.crc32(body) != crc:
        return None
    try:
        decoded = msgspec.msgpack.decode(body, type=_Body)
    except msgspec.DecodeError:
        return None
    if len(decoded.identity) != IDENTITY_BYTES:
        return None
    return Superblock(decoded.identity, decoded.geometry, decoded.formatted_at)


def unreadable_reason(data: bytes | memoryview) -> str:
    """Why a superblock with our magic did not decode: written by a newer server in a
    format version this code does not read (a downgrade), or damaged."""
    view = memoryview(data).cast("B")
    if len(view) >= _FIXED.size:
        version = _FIXED.unpack_from(view)[1]
        if version > SUPERBLOCK_VERSION:
            return (
                f"its superblock is of format version {version}, newer than the "
                f"{SUPERBLOCK_VERSION} this code reads"
            )
    return "its superblock is damaged"


def has_magic(data: bytes | memoryview, magic: bytes) -> bool:
    """Whether ``data`` starts with ``magic`` (a superblock of ours, intact or not)."""
    return bytes(memoryview(data)[: len(magic)]) == magic


# (offset, bytes, what) of signatures that mean "this device is in use by something else"
_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, RAW_BLOCK_MAGIC, "a raw_block slot store"),
    (0, DAX_MAGIC, "a dax mapping"),
    (512, b"EFI PART", "a GPT partition table"),
    (0, b"XFSB", "an XFS filesystem"),
    (1080, b"\x53\xef", "an ext2/3/4 filesystem"),
    (65600, b"_BHRfS_M", "a btrfs filesystem"),
    (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
    (536, b"LVM2 001", "an LVM physical volume"),
    (4086, b"SWAPSPACE2", "a swap area"),
    (0, b"hsqs", "a squashfs image"),
    (32769, b"CD001", "an ISO 9660 image"),
    (3, b"NTFS    ", "an NTFS filesystem"),
    (82, b"FAT32   ", "a FAT32 filesystem"),
    (510, b"\x55\xaa", "a partition table or boot sector"),
)


def own_block(data: bytes | memoryview, magic: bytes, block_align: int) -> int | None:
    """``within`` for :func:`foreign_signature` of a device whose first bytes are ``data``:
    with a superblock of ours (``magic``), the block that holds it and zeros -- that of the
    format that wrote it when it can be read, else ``block_align``; None without one."""
    if not has_magic(data, magic):
        return None
    superblock = decode_superblock(data, magic)
    written = superblock.geometry.get("block_align", 0) if superblock is not None else 0
    return min(block_align, written or block_align)


def foreign_signature(data: bytes | memoryview, own_magic: bytes, *, within: int | None = None) -> str | None:
    """What the first :data:`SIGNATURE_PROBE_BYTES` of a device say it holds, if they
    carry a known filesystem or partition signature or lmcache-tiers data other than a
    superblock with ``own_magic``; None otherwise.

    ``within``: only the signatures lying wholly in the first ``within`` bytes -- for a
    device with a superblock of ours, its block, which holds the superblock and zeros
    (past it lie checkpoints, index and slots, whose bytes may match a signature by
    chance).
    """
    view = memoryview(data).cast("B")
    end = len(view) if within is None else min(within, len(view))
    for offset, signature, what in _SIGNATURES:
        if signature != own_magic and bytes(view[offset : min(offset + len(signature), end)]) == signature:
            return what
    head = bytes(view[: len(own_magic)])
    if head.startswith(_TIERS_PREFIX) and head != own_magic:
        # A format of this project that this adapter does not know: never ours to wipe.
        return f"lmcache-tiers data of another kind (magic {head!r})"
    return None
