"""A frame of a newer release met by a server sharing a store during a rolling upgrade:
a miss counted and explained as written by a newer release, not as a damaged frame, so an
operator reading the counters does not hunt for corruption that is not there."""

from __future__ import annotations

import struct

import pytest
import xxhash
from lmcache_plugin_serde_zstd.codec import MAGIC, METHOD_STORED, VERSION, ZstdFrameError, ZstdSerde

from lmcache_tiers.plugin import SerdeContext
from lmcache_tiers.testing.serde import kv_like_bf16, suite_key

# The documented frame: magic, version, method, level, element size, original length,
# payload length, then an xxh3_64 of the 24 bytes before it and the payload.
_HEADER = struct.Struct("<4sBBbBQQ")


def _stored_frame_of_version(data: bytes, version: int) -> bytes:
    """A well-formed stored (uncompressed) frame whose header names ``version``."""
    header = _HEADER.pack(MAGIC, version, METHOD_STORED, 3, 1, len(data), len(data))
    checksum = xxhash.xxh3_64(header + data).intdigest()
    return header + checksum.to_bytes(8, "little") + data


def test_a_frame_of_a_newer_version_is_refused_as_a_newer_format_not_as_corrupt() -> None:
    serde, data = ZstdSerde(), kv_like_bf16(seed=21)
    frame = _stored_frame_of_version(data, VERSION + 1)
    with pytest.raises(ZstdFrameError, match=f"version {VERSION + 1} frame, written by a newer release"):
        serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data)))
    stats = serde.stats()
    assert stats["newer_frames"] == 1
    assert stats["corrupt_frames"] == 0
    assert stats["decoded_objects"] == 0


def test_a_frame_of_this_version_built_from_the_documented_format_is_read() -> None:
    """The fixture above follows the format this release writes: the same builder at
    this version decodes, so the refusal above is about the version alone."""
    serde, data = ZstdSerde(), kv_like_bf16(seed=22)
    frame = _stored_frame_of_version(data, VERSION)
    assert bytes(serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data)))) == data
    assert serde.stats()["newer_frames"] == 0


def test_a_frame_with_another_magic_is_still_counted_as_corrupt() -> None:
    serde, data = ZstdSerde(), kv_like_bf16(seed=23)
    frame = b"XXXX" + _stored_frame_of_version(data, VERSION + 1)[4:]
    with pytest.raises(ZstdFrameError, match="not a zstd serde frame"):
        serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data)))
    assert serde.stats()["corrupt_frames"] == 1
    assert serde.stats()["newer_frames"] == 0


@pytest.mark.parametrize("bit", range(1, 8))
def test_a_version_field_a_flipped_bit_raised_is_counted_as_corrupt_not_newer(bit: int) -> None:
    # A bit flipped in the version field of a frame this release wrote reads as a higher
    # version: only the checksum tells that frame from one a newer release wrote.
    serde, data = ZstdSerde(), kv_like_bf16(seed=24)
    frame = bytearray(serde.encode(memoryview(data), SerdeContext(suite_key(), len(data))))
    frame[4] ^= 1 << bit
    with pytest.raises(ZstdFrameError, match="checksum"):
        serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data)))
    assert serde.stats()["corrupt_frames"] == 1
    assert serde.stats()["newer_frames"] == 0
