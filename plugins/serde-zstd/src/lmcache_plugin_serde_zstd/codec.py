"""The ``zstd`` serde: a self-describing, checksummed Zstandard frame per object.

Frame layout (little-endian)::

    magic "LTZS" | version u8 | method u8 | level i8 | element_size u8
    | original_len u64 | payload_len u64 | xxh3_64 u64 | payload

``method`` is 1 for a Zstandard frame, 0 for an object stored as it was because
compression did not make it smaller (random or already encrypted bytes), which bounds every
frame at the object size plus the header.  ``element_size`` > 1 means the payload
compresses the byte planes of the object (see :mod:`.shuffle`).  The checksum covers the
24 header bytes before it and the payload, and is verified before any length in the
header is trusted, so a damaged frame is refused rather than decompressed; the decoder
reads method, element size and lengths from the frame, never from the configuration.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import Counter
from typing import Final

import xxhash
import zstandard

from lmcache_plugin_serde_zstd import ZstdConfig
from lmcache_plugin_serde_zstd.shuffle import shuffle_into, unshuffle_into
from lmcache_tiers.plugin import SerdeContext

log = logging.getLogger("lmcache_tiers.serde.zstd")

MAGIC: Final = b"LTZS"
VERSION: Final = 1
METHOD_STORED: Final = 0
METHOD_ZSTD: Final = 1
_HEADER = struct.Struct("<4sBBbBQQQ")
HEADER_SIZE: Final = _HEADER.size
_CHECKED = HEADER_SIZE - 8  # header bytes before the checksum field
#: a frame claiming to expand past this many times its object's L1 size (plus 1 MiB)
#: is refused before anything is allocated for it
_MAX_EXPANSION: Final = 4


#: what ``stats()`` reports
COUNTERS: Final = (
    "compressed_objects",
    "stored_raw_objects",
    "shuffled_objects",
    "bytes_in",
    "bytes_out",
    "decoded_objects",
    "corrupt_frames",
    "newer_frames",
)


class ZstdFrameError(ValueError):
    """The bytes are not an intact frame of this serde."""


class ZstdNewerFrameError(ZstdFrameError):
    """A frame of a later version than this release reads: written by a newer release
    sharing the store, not damage."""


def _damaged_version(version: int) -> str:
    if version > VERSION:
        return f"frame version {version} with a checksum mismatch: damaged, not a newer release's"
    return f"frame version {version} is not {VERSION}"


def _digest(header_start: bytes | memoryview, payload: bytes | memoryview) -> int:
    state = xxhash.xxh3_64()
    state.update(header_start)
    state.update(payload)
    return int(state.intdigest())


class ZstdSerde:
    """Zstandard compression per object; see the module docstring for the frame."""

    name = "zstd"

    def __init__(self, config: ZstdConfig | None = None) -> None:
        self.config = config or ZstdConfig()
        # Compression contexts are not safe to share between threads; each adapter
        # worker thread gets its own, kept for the thread's life.
        self._local = threading.local()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ZstdSerde(level={self.config.level}, shuffle={self.config.shuffle})"

    # -- Serde ------------------------------------------------------------------------------

    def max_encoded_size(self, size: int) -> int:
        return HEADER_SIZE + size

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        view = memoryview(data).cast("B")
        element_size = self._element_size(view, context)
        source: memoryview = view
        if element_size > 1:
            planes = bytearray(view.nbytes)
            shuffle_into(view, memoryview(planes), element_size)
            source = memoryview(planes)
        compressed = self._compressor().compress(source)
        payload: bytes | memoryview  # the compressed bytes, or the input as it came
        if len(compressed) < view.nbytes:
            method, payload = METHOD_ZSTD, compressed
        else:
            method, element_size, payload = METHOD_STORED, 1, view
        header = _HEADER.pack(
            MAGIC, VERSION, method, self.config.level, element_size, view.nbytes, len(payload), 0
        )
        checksum = _digest(header[:_CHECKED], payload)
        self._count(
            ("compressed_objects" if method == METHOD_ZSTD else "stored_raw_objects", 1),
            ("shuffled_objects", int(element_size > 1)),
            ("bytes_in", view.nbytes),
            ("bytes_out", HEADER_SIZE + len(payload)),
        )
        return b"".join((header[:_CHECKED], checksum.to_bytes(8, "little"), payload))

    def decode(self, data: memoryview, context: SerdeContext) -> bytes | memoryview:
        view = memoryview(data).cast("B")
        try:
            return self._decode(view, context)
        except ZstdFrameError as exc:
            self._count(("newer_frames" if isinstance(exc, ZstdNewerFrameError) else "corrupt_frames", 1))
            log.debug("zstd: refused the frame of %s: %s", context.key, exc)
            raise

    def stats(self) -> dict[str, int]:
        """Objects and bytes through this serde, and frames it refused."""
        with self._lock:
            return dict(self._counters)

    # -- internals --------------------------------------------------------------------------

    def _decode(self, view: memoryview, context: SerdeContext) -> bytes | memoryview:
        if view.nbytes < HEADER_SIZE:
            raise ZstdFrameError(f"{view.nbytes} bytes is shorter than a zstd frame header")
        magic, version, method, _level, element_size, original_len, payload_len, checksum = (
            _HEADER.unpack_from(view)
        )
        if magic != MAGIC:
            raise ZstdFrameError(f"bad magic {bytes(magic)!r}: not a zstd serde frame")
        if version > VERSION and _digest(view[:_CHECKED], view[HEADER_SIZE:]) == checksum:
            # Kept in the store: the servers already upgraded read it.  Later versions keep
            # this header prefix and checksum rule, so the checksum tells such a frame from
            # one of this version whose version field a flipped bit raised (damage).
            raise ZstdNewerFrameError(
                f"a version {version} frame, written by a newer release (this one reads version "
                f"{VERSION}); a miss here until stored again, kept for the servers that read it"
            )
        if version != VERSION:
            raise ZstdFrameError(_damaged_version(version))
        payload = view[HEADER_SIZE:]
        if payload.nbytes != payload_len:
            raise ZstdFrameError(f"payload is {payload.nbytes} bytes, the frame says {payload_len}")
        if _digest(view[:_CHECKED], payload) != checksum:
            raise ZstdFrameError("frame checksum mismatch")
        if original_len > _MAX_EXPANSION * context.size + (1 << 20):
            raise ZstdFrameError(f"frame claims {original_len} bytes for an object of {context.size}")
        if method == METHOD_STORED:
            if original_len != payload_len:
                raise ZstdFrameError("stored frame whose lengths differ")
            self._count(("decoded_objects", 1))
            return payload
        if method != METHOD_ZSTD or element_size < 1:
            raise ZstdFrameError(f"unknown method {method} / element size {element_size}")
        try:
            # The zstd frame's own content size decides what zstandard allocates: it must
            # agree with the (checksummed) header before anything is decompressed.
            if zstandard.frame_content_size(payload) != original_len:
                raise ZstdFrameError("the zstd frame's content size disagrees with the header")
            output = self._decompressor().decompress(payload, max_output_size=original_len)
        except zstandard.ZstdError as exc:
            raise ZstdFrameError(f"zstd could not decompress the payload: {exc}") from exc
        if len(output) != original_len:
            raise ZstdFrameError(f"decompressed {len(output)} bytes, the frame says {original_len}")
        self._count(("decoded_objects", 1))
        if element_size == 1:
            return output
        restored = bytearray(original_len)
        unshuffle_into(memoryview(output), memoryview(restored), element_size)
        return memoryview(restored)

    def _element_size(self, view: memoryview, context: SerdeContext) -> int:
        if not self.config.shuffle:
            return 1
        layout = context.tensor_layout
        if layout is not None and layout.nbytes == view.nbytes:
            return layout.itemsize
        # No layout, or one that describes other bytes (an earlier serde changed them).
        return self.config.element_size or 1

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor: zstandard.ZstdCompressor | None = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(
                level=self.config.level, write_content_size=True, write_checksum=False
            )
            self._local.compressor = compressor
        return compressor

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor: zstandard.ZstdDecompressor | None = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = zstandard.ZstdDecompressor()
            self._local.decompressor = decompressor
        return decompressor

    def _count(self, *amounts: tuple[str, int]) -> None:
        with self._lock:
            for name, amount in amounts:
                if amount:
                    self._counters[name] += amount
