"""The zstd serde: the conformance suite, the frame, the shuffle and the config."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import zstandard
from lmcache_plugin_serde_zstd import ZstdConfig
from lmcache_plugin_serde_zstd.codec import HEADER_SIZE, ZstdFrameError, ZstdSerde

from lmcache_tiers.plugin import SerdeContext
from lmcache_tiers.testing.serde import (
    DETECTS_CORRUPTION,
    KV_SHAPE,
    LOSSLESS,
    SerdeSuite,
    kv_layout,
    kv_like_bf16,
    random_bytes,
    suite_key,
)


class TestZstdSerde(SerdeSuite):
    component_name = "zstd"
    capabilities = frozenset({LOSSLESS, DETECTS_CORRUPTION})


class TestZstdWithoutShuffle(SerdeSuite):
    component_name = "zstd"
    capabilities = frozenset({LOSSLESS, DETECTS_CORRUPTION})

    def make_config(self) -> ZstdConfig:
        return ZstdConfig(level=6, shuffle=False)


class TestZstdWithConfiguredElementSize(SerdeSuite):
    component_name = "zstd"
    capabilities = frozenset({LOSSLESS, DETECTS_CORRUPTION})

    def make_config(self) -> ZstdConfig:
        return ZstdConfig(level=-3, element_size=4)


def _context(data: bytes, layout: str = "") -> SerdeContext:
    return SerdeContext(suite_key(), len(data), layout)


def _header(frame: bytes) -> tuple[object, ...]:
    return struct.unpack_from("<4sBBbBQQQ", frame)


def test_frame_records_codec_level_and_element_size() -> None:
    data = kv_like_bf16()
    frame = ZstdSerde(ZstdConfig(level=5)).encode(memoryview(data), _context(data, kv_layout(KV_SHAPE)))
    magic, version, method, level, element_size, original, payload, _ = _header(frame)
    assert (magic, version, method, level, element_size) == (b"LTZS", 1, 1, 5, 2)
    assert (original, payload) == (len(data), len(frame) - HEADER_SIZE)
    assert zstandard.frame_content_size(frame[HEADER_SIZE:]) == len(data)


def test_any_config_decodes_frames_of_any_other() -> None:
    """Level and shuffle are read from the frame: changing them keeps old objects readable."""
    data = kv_like_bf16(seed=3)
    writers = [ZstdSerde(ZstdConfig(level=level, shuffle=s)) for level in (-5, 1, 9) for s in (True, False)]
    frames = [w.encode(memoryview(data), _context(data, kv_layout(KV_SHAPE))) for w in writers]
    for reader in writers:
        for frame in frames:
            assert bytes(memoryview(reader.decode(memoryview(frame), _context(data))).cast("B")) == data


def test_shuffle_makes_bf16_kv_smaller() -> None:
    data = kv_like_bf16(seed=4)
    context = _context(data, kv_layout(KV_SHAPE))
    shuffled = ZstdSerde(ZstdConfig(shuffle=True)).encode(memoryview(data), context)
    plain = ZstdSerde(ZstdConfig(shuffle=False)).encode(memoryview(data), context)
    assert len(shuffled) < 0.75 * len(data) < len(plain)


def test_layout_element_size_applies_only_to_the_bytes_it_describes() -> None:
    data = kv_like_bf16(seed=5)
    other = data[: len(data) // 2]  # e.g. the output of an earlier serde in the chain
    serde = ZstdSerde(ZstdConfig(element_size=4))
    frame = serde.encode(memoryview(other), SerdeContext(suite_key(), len(data), kv_layout(KV_SHAPE)))
    assert _header(frame)[4] == 4  # the configured size, not the layout's 2
    frame = ZstdSerde().encode(memoryview(other), SerdeContext(suite_key(), len(data), kv_layout(KV_SHAPE)))
    assert _header(frame)[4] == 1


def test_incompressible_objects_are_stored_and_bounded() -> None:
    serde = ZstdSerde()
    data = random_bytes(1 << 20, 6)
    frame = serde.encode(memoryview(data), _context(data))
    assert _header(frame)[2] == 0  # stored
    assert len(frame) == serde.max_encoded_size(len(data)) == len(data) + HEADER_SIZE
    assert bytes(memoryview(serde.decode(memoryview(frame), _context(data))).cast("B")) == data
    assert serde.stats()["stored_raw_objects"] == 1


def test_counters() -> None:
    serde = ZstdSerde()
    data = kv_like_bf16(seed=7)
    frame = serde.encode(memoryview(data), _context(data, kv_layout(KV_SHAPE)))
    serde.decode(memoryview(frame), _context(data))
    damaged = bytearray(frame)
    damaged[-1] ^= 1
    with pytest.raises(ZstdFrameError, match="checksum"):
        serde.decode(memoryview(damaged), _context(data))
    stats = serde.stats()
    assert stats["compressed_objects"] == stats["shuffled_objects"] == stats["decoded_objects"] == 1
    assert stats["corrupt_frames"] == 1
    assert stats["bytes_in"] == len(data) and stats["bytes_out"] == len(frame)


def _forge(original_len: int, payload: bytes, method: int = 1, element_size: int = 1) -> bytes:
    """A frame with a valid checksum (xxh3 is no MAC: anyone who can write storage can do this)."""
    import xxhash

    head = struct.pack("<4sBBbBQQ", b"LTZS", 1, method, 1, element_size, original_len, len(payload))
    return head + xxhash.xxh3_64_intdigest(head + payload).to_bytes(8, "little") + payload


def test_forged_frames_cannot_make_the_decoder_allocate_huge_buffers() -> None:
    serde = ZstdSerde()
    small = zstandard.ZstdCompressor().compress(b"x" * 1000)
    with pytest.raises(ZstdFrameError, match="claims"):
        serde.decode(memoryview(_forge(1 << 40, small)), SerdeContext(suite_key(), 1000))
    # The zstd frame's own content size is checked against the header before decompressing.
    huge = zstandard.ZstdCompressor().compress(bytes(50 << 20))
    with pytest.raises(ZstdFrameError, match="content size"):
        serde.decode(memoryview(_forge(1000, huge)), SerdeContext(suite_key(), 1000))
    with pytest.raises(ZstdFrameError, match="method"):
        serde.decode(memoryview(_forge(1000, small, method=7)), SerdeContext(suite_key(), 1000))


def test_config_bounds() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"level": 23}, ZstdConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"element_size": 0}, ZstdConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"codec": "lz4"}, ZstdConfig)


def test_shuffle_round_trips_odd_tails() -> None:
    from lmcache_plugin_serde_zstd.shuffle import shuffle_into, unshuffle_into

    for element_size in (2, 3, 4, 8):
        for size in (0, 1, element_size, 1001, 4096 + 3):
            data = random_bytes(size, size)
            planes, back = bytearray(size), bytearray(size)
            shuffle_into(memoryview(data), memoryview(planes), element_size)
            whole = size - size % element_size
            expected = np.frombuffer(data[:whole], np.uint8).reshape(-1, element_size).T.tobytes()
            assert bytes(planes) == expected + data[whole:]
            unshuffle_into(memoryview(bytes(planes)), memoryview(back), element_size)
            assert bytes(back) == data
