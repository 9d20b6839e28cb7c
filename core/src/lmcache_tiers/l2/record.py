"""Record format of persistent adapters: a self-describing header stored with each object.

Layout (little-endian)::

    magic "LMTR" | version u16 | flags u16 | header_len u32 | payload_len u64 | l1_size u64
    | checksum_algo u8 | 3 reserved | payload checksum 16B | key_len u16 | layout_len u16
    | serde_len u16 | key (ObjectKey.to_bytes) | layout (utf-8) | serde names (utf-8, ",")
    | zero padding to the requested alignment | header crc32 u32

``header_len`` counts everything up to and including the header crc, so the payload starts
at ``header_len``.  The header crc catches a torn or bit-flipped header before any of its
lengths are trusted; the payload checksum catches a damaged payload.

What every format version keeps (so a reader tells another version's intact record from
damage): the magic at 0, the version u16 at 4, ``header_len`` u32 at 8 (from ``PREFIX_SIZE``
+ 4 to ``MAX_HEADER_LEN``), and the header crc -- ``zlib.crc32`` of bytes
``[0, header_len - 4)``, stored u32 at ``header_len - 4``.  A record whose version is not
this code's counts as another version's only when that crc verifies.  ``l1_size`` is the
decoded (L1) size, which a size-changing serde chain makes differ from ``payload_len``: a
persistent backend reports it from the header after a restart, when the adapter has no
memory of the key (see ``ObjectSize``).  Any mismatch raises a :class:`RecordError`
subclass; callers turn it into a miss and delete the object -- except a record of another
serde chain (:class:`RecordSerdeMismatchError`), which is intact and kept.

Checksum: XXH3-128 (plenty against accidental corruption; this is not a MAC -- the
AES-GCM serde is what defends against tampering).  It is verified on every load, so its
speed bounds load throughput from the page cache: over 64 MiB on a 2-vCPU machine of
this project XXH3-128 ran at ~24 GB/s, blake3 (the first algorithm, id 1, still read)
at ~5 GB/s and zlib.crc32 at ~3.8 GB/s.  The algorithm id in the header is what lets
records written with either be verified.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple, NoReturn

import blake3
import msgspec
import xxhash

from lmcache_tiers.errors import KeyValidationError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.headercrc import crc32_zero_padded

RECORD_MAGIC: Final = b"LMTR"
RECORD_VERSION: Final = 1
CHECKSUM_BLAKE3_128: Final = 1
CHECKSUM_XXH3_128: Final = 2
CHECKSUM_SIZE: Final = 16
#: a header_len beyond this is taken as corruption rather than trusted for a read
MAX_HEADER_LEN: Final = 1 << 16

_FIXED = struct.Struct(f"<4sHHIQQB3x{CHECKSUM_SIZE}sHHH")
_CRC = struct.Struct("<I")
#: bytes a reader needs to learn ``header_len`` (see :func:`header_length`)
PREFIX_SIZE: Final = _FIXED.size
#: bytes of the header crc that ends every header (after its zero padding)
HEADER_CRC_SIZE: Final = _CRC.size


class RecordError(TiersError):
    """A stored record cannot be trusted; the object must be treated as a miss."""


class RecordCorruptError(RecordError):
    """The header is truncated, has a bad magic or a bad header crc."""


class RecordL1SizeError(RecordCorruptError):
    """The header is intact (its crc matched) but claims an L1 size no object can have
    (``BackendContext.read_record_header``): forged or miswritten, damaged all the same."""


class RecordVersionError(RecordError):
    """The record was written in a format version this code does not read."""


class RecordChecksumError(RecordError):
    """The payload does not match the checksum in its header."""


class RecordMismatchError(RecordError):
    """The record is intact but belongs to another key or another serde chain."""


class RecordSerdeMismatchError(RecordMismatchError):
    """The record is intact and of this key, but written with another serde chain.

    It cannot be read with the configured chain; it is not damaged either (configuring
    the chain it names again makes it readable), so adapters report a miss and keep it.
    """


class RecordVerdict(enum.Enum):
    """What becomes of a stored record read back that cannot serve the key it was read for.

    The one rule of every header read -- lookups, loads, deletes, listings of every
    adapter: a record that is intact but not this server's to read is a miss that is kept
    (its writer reads it) and counted; a damaged one is a miss that is removed and counted.
    The value is the counter.
    """

    #: another key's intact record under this key's name (a server whose key prefix
    #: extends this one's, another adapter type sharing the store): kept
    FOREIGN = "foreign_records"
    #: a record of a format version this code does not read (a newer server sharing the
    #: store, which reads it): kept
    NEWER = "record_version_unknown"
    #: a torn, truncated or bit-flipped record: removed (only if it is still the record
    #: judged: a record stored there since is kept)
    DAMAGED = "corrupt_records_removed"

    @property
    def kept(self) -> bool:
        return self is not RecordVerdict.DAMAGED

    @property
    def counter(self) -> str:
        return self.value


def record_verdict(error: RecordError) -> RecordVerdict:
    """The :class:`RecordVerdict` on a record whose reading raised ``error``."""
    if isinstance(error, RecordMismatchError):
        return RecordVerdict.FOREIGN
    if isinstance(error, RecordVersionError):
        return RecordVerdict.NEWER
    return RecordVerdict.DAMAGED


class RecordHeader(NamedTuple):
    """A decoded header (a named tuple: loads decode one per object, and building a
    frozen dataclass cost a third of a header's decoding)."""

    key: ObjectKey
    payload_len: int
    l1_size: int
    serde: tuple[str, ...]
    checksum: bytes
    layout: str = ""
    header_len: int = 0
    version: int = RECORD_VERSION
    checksum_algo: int = CHECKSUM_XXH3_128


def _blake3_128(payload: bytes | memoryview) -> bytes:
    return blake3.blake3(payload).digest(CHECKSUM_SIZE)


def _xxh3_128(payload: bytes | memoryview) -> bytes:
    return bytes(xxhash.xxh3_128_digest(payload))


_CHECKSUMS: dict[int, Callable[[bytes | memoryview], bytes]] = {
    CHECKSUM_BLAKE3_128: _blake3_128,
    CHECKSUM_XXH3_128: _xxh3_128,
}


def checksum(payload: bytes | memoryview, algo: int = CHECKSUM_XXH3_128) -> bytes:
    """128-bit digest of the payload with the given algorithm (new records: XXH3-128)."""
    return _CHECKSUMS[algo](payload)


def encode_header(
    key: ObjectKey,
    payload: bytes | memoryview,
    *,
    l1_size: int | None = None,
    serde: Sequence[str] = (),
    layout: str = "",
    align: int = 1,
    digest: bytes | None = None,
) -> bytes:
    """Header for ``payload`` stored under ``key``; the payload follows it.

    ``l1_size`` defaults to the payload length (no size-changing serde).  ``align`` pads
    the header to a multiple of it so the payload can start on a block boundary.
    ``digest`` is the payload's XXH3-128 checksum when the caller already took it (while
    copying the payload, see :func:`lmcache_tiers.l2.verified.copy_and_checksum`).
    """
    if digest is not None and len(digest) != CHECKSUM_SIZE:
        raise ValueError(f"a payload digest is {CHECKSUM_SIZE} bytes, not {len(digest)}")
    if align < 1:
        raise ValueError("align must be >= 1")
    if any("," in name or not name for name in serde):
        raise ValueError(f"serde names must be non-empty and contain no ',': {list(serde)}")
    payload_len = memoryview(payload).nbytes
    key_bytes = key.to_bytes()
    layout_bytes = layout.encode()
    serde_bytes = ",".join(serde).encode()
    fixed = _FIXED.pack(
        RECORD_MAGIC,
        RECORD_VERSION,
        0,
        0,  # header_len, patched below once padding is known
        payload_len,
        payload_len if l1_size is None else l1_size,
        CHECKSUM_XXH3_128,
        checksum(payload) if digest is None else digest,
        len(key_bytes),
        len(layout_bytes),
        len(serde_bytes),
    )
    body = fixed + key_bytes + layout_bytes + serde_bytes
    header_len = -(-(len(body) + _CRC.size) // align) * align
    if header_len > MAX_HEADER_LEN:
        raise ValueError(f"record header of {header_len} bytes exceeds {MAX_HEADER_LEN}")
    body = body[:8] + struct.pack("<I", header_len) + body[12:]
    body += bytes(header_len - _CRC.size - len(body))
    return body + _CRC.pack(zlib.crc32(body))


def header_length(prefix: bytes | memoryview) -> int:
    """Total header length, read from the first ``PREFIX_SIZE`` bytes of a record.

    The version is not judged here: only the header crc, at the end of the header, tells
    another version's record from one of this version whose version field is damaged, so
    :func:`decode_header` judges it once the whole header is read."""
    if len(prefix) < PREFIX_SIZE:
        raise RecordCorruptError(f"record is {len(prefix)} bytes long, shorter than a header")
    magic, _version, _flags, header_len = struct.unpack_from("<4sHHI", prefix)
    _check_start(magic, header_len)
    return int(header_len)


def _check_start(magic: bytes, header_len: int) -> None:
    """Raise unless a header's first fields are those every record version keeps: the
    magic, and a header length its crc can be looked for at (not yet trusted beyond that)."""
    if magic != RECORD_MAGIC:
        raise RecordCorruptError(f"bad record magic {bytes(magic)!r}")
    if not PREFIX_SIZE + _CRC.size <= header_len <= MAX_HEADER_LEN:
        raise RecordCorruptError(f"implausible record header length {header_len}")


def _refuse_other_version(view: memoryview, version: int, header_len: int) -> NoReturn:
    """Judge a record whose version field is not this code's: another version's record
    (kept: its writer reads it) only if its header crc verifies by the rule every version
    keeps; otherwise damage -- a flipped bit in this version's field reads as 3, 5, 9, ..."""
    if view.nbytes < header_len:
        # A newer format's header may be longer than a reader fetches for a key: its crc
        # cannot be taken, and removing another server's intact record would lose its
        # write.  (This version's own damaged headers fit the read: their length is intact.)
        raise RecordVersionError(
            f"record format version {version} is not {RECORD_VERSION} (its {header_len}-byte "
            f"header was not read whole, {view.nbytes} bytes, so its crc is not checked)"
        )
    crc_at = header_len - _CRC.size
    (stored_crc,) = _CRC.unpack_from(view, crc_at)
    if zlib.crc32(view[:crc_at]) != stored_crc:
        raise RecordCorruptError(
            f"record header crc mismatch (version field {version}: damaged, not another version's)"
        )
    raise RecordVersionError(f"record format version {version} is not {RECORD_VERSION}")


def _encoded_serde(names: tuple[str, ...]) -> bytes:
    """The serde field a record written with the chain ``names`` holds."""
    encoded = _SERDE_FIELDS.get(names)
    if encoded is None:
        encoded = ",".join(names).encode()
        if len(_SERDE_FIELDS) >= 64:  # chains are few; never let odd callers grow it
            _SERDE_FIELDS.clear()
        _SERDE_FIELDS[names] = encoded
    return encoded


#: encoded serde field per expected chain (a tuple of names): one per adapter in practice
_SERDE_FIELDS: dict[tuple[str, ...], bytes] = {}


def decode_header(
    data: bytes | memoryview,
    *,
    expected_key: ObjectKey | None = None,
    expected_serde: Sequence[str] | None = None,
) -> RecordHeader:
    """Parse and verify a header; ``data`` may extend past it (e.g. the whole record).

    Every load decodes one header per object, so the usual case -- a record of the
    expected key and serde chain -- is kept to one ``struct`` unpack of the fixed part,
    the header crc (:func:`~lmcache_tiers.l2.headercrc.crc32_zero_padded`: no crc32 run
    over the zero padding) and two byte comparisons against the expected encodings: no
    key, serde tuple or padding copy is built.  Anything else takes the full decoding,
    which explains what differs.
    """
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = view.nbytes
    if size < PREFIX_SIZE:
        raise RecordCorruptError(f"record is {size} bytes long, shorter than a header")
    (magic, version, _f, header_len, payload_len, l1_size, algo, digest, key_len, layout_len, serde_len) = (
        _FIXED.unpack_from(view)
    )
    _check_start(magic, header_len)
    if version != RECORD_VERSION:
        _refuse_other_version(view, version, header_len)
    if size < header_len:
        raise RecordCorruptError(f"record header is truncated ({size} of {header_len} bytes)")
    crc_at = header_len - _CRC.size
    layout_at = PREFIX_SIZE + key_len
    serde_at = layout_at + layout_len
    end = serde_at + serde_len
    # The field lengths are not trusted yet: they only say where the zero padding should
    # start, and a wrong guess just takes zlib over the whole range.
    (stored_crc,) = _CRC.unpack_from(view, crc_at)
    if crc32_zero_padded(view, min(end, crc_at), crc_at) != stored_crc:
        raise RecordCorruptError("record header crc mismatch")
    if algo not in _CHECKSUMS:
        raise RecordVersionError(f"unknown record checksum algorithm {algo}")
    if end > crc_at:
        raise RecordCorruptError("record header fields overrun the header")
    key: ObjectKey | None = None
    serde: tuple[str, ...] | None = None
    if expected_key is not None:
        expected = expected_key.to_bytes()
        if key_len == len(expected) and expected.startswith(view[PREFIX_SIZE:layout_at]):
            key = expected_key  # the same encoded bytes: that key, not built again
    if expected_serde is not None and type(expected_serde) is tuple:
        expected = _encoded_serde(expected_serde)
        if serde_len == len(expected) and (not serde_len or expected.startswith(view[serde_at:end])):
            serde = expected_serde
    try:
        if key is None:
            key = ObjectKey.from_bytes(bytes(view[PREFIX_SIZE:layout_at]))
        layout = str(view[layout_at:serde_at], "utf-8") if layout_len else ""
        if serde is None:
            serde_text = str(view[serde_at:end], "utf-8") if serde_len else ""
            serde = tuple(serde_text.split(",")) if serde_text else ()
    except (KeyValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        # DecodeError: key bytes that are no msgpack at all (ObjectKey.from_bytes turns
        # only a failed validation into a KeyValidationError)
        raise RecordCorruptError(f"record header fields are invalid: {exc}") from exc
    header = RecordHeader(key, payload_len, l1_size, serde, digest, layout, header_len, version, algo)
    if expected_key is not None and key is not expected_key and key != expected_key:
        raise RecordMismatchError(f"record holds key {key.file_stem()}, not {expected_key.file_stem()}")
    if expected_serde is not None and serde is not expected_serde and serde != tuple(expected_serde):
        raise RecordSerdeMismatchError(
            f"record was written with serde chain {list(serde)}, configured is {list(expected_serde)}"
        )
    return header


def verify_payload(header: RecordHeader, payload: bytes | memoryview) -> None:
    """Raise :class:`RecordChecksumError` unless ``payload`` is what ``header`` describes."""
    length = memoryview(payload).nbytes
    if length != header.payload_len:
        raise RecordChecksumError(f"payload is {length} bytes, header says {header.payload_len}")
    if checksum(payload, header.checksum_algo) != header.checksum:
        raise RecordChecksumError(f"payload checksum mismatch for {header.key.file_stem()}")


_STREAMS: dict[int, Callable[[], Any]] = {
    CHECKSUM_BLAKE3_128: blake3.blake3,
    CHECKSUM_XXH3_128: xxhash.xxh3_128,
}


class PayloadVerifier:
    """:func:`verify_payload` for a payload read in pieces: ``update`` each piece in order
    (each while it is still in the CPU's cache), then ``verify``.

    Loops that move a payload in pieces and know how many bytes they fed may call
    ``hash_update`` (the hash's own ``update``, without the length bookkeeping) and pass
    the total to ``verify``.
    """

    __slots__ = ("_hash", "_header", "_length", "hash_update")

    def __init__(self, header: RecordHeader) -> None:
        self._header = header
        self._hash = _STREAMS[header.checksum_algo]()
        self._length = 0
        self.hash_update: Callable[[Any], None] = self._hash.update

    def update(self, piece: bytes | memoryview) -> None:
        self._hash.update(piece)
        self._length += memoryview(piece).nbytes

    def verify(self, length: int | None = None) -> None:
        """Raise :class:`RecordChecksumError` unless the pieces are what the header
        describes; ``length``: the bytes fed through ``hash_update``."""
        header = self._header
        fed = self._length if length is None else length
        if fed != header.payload_len:
            raise RecordChecksumError(f"payload is {fed} bytes, header says {header.payload_len}")
        digest = (
            self._hash.digest(CHECKSUM_SIZE)
            if header.checksum_algo == CHECKSUM_BLAKE3_128
            else self._hash.digest()
        )
        if bytes(digest) != header.checksum:
            raise RecordChecksumError(f"payload checksum mismatch for {header.key.file_stem()}")


def decode_record(
    data: bytes | memoryview,
    *,
    expected_key: ObjectKey | None = None,
    expected_serde: Sequence[str] | None = None,
) -> tuple[RecordHeader, memoryview]:
    """Header and verified payload of a whole record read in one piece (no copy)."""
    view = memoryview(data).cast("B")
    header = decode_header(view, expected_key=expected_key, expected_serde=expected_serde)
    payload = view[header.header_len : header.header_len + header.payload_len]
    verify_payload(header, payload)
    return header, payload
