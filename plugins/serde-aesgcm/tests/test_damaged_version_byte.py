"""A frame whose version byte reads later than this release's formats is either a newer
release's or one of this release's damaged.  The version byte is authenticated, so a frame
that authenticates with one of this release's versions put back is proven damaged and
counted as ``corrupt_frames``; any other is ``newer_frames``, whose reason says "newer
release or damaged".  Either way the decode is a miss, never bytes."""

from __future__ import annotations

import os

import msgspec
import pytest
from lmcache_plugin_serde_aesgcm import AesGcmConfig
from lmcache_plugin_serde_aesgcm import cipher as cipher_module
from lmcache_plugin_serde_aesgcm.cipher import HEADER_SIZE, VERSION, AesGcmDecodeError, AesGcmSerde

from lmcache_tiers.plugin import SerdeContext
from lmcache_tiers.testing.serde import KV_SHAPE, kv_layout, kv_like_bf16, suite_key

KEY = bytes(range(90, 122))
ENV = "TIERS_TEST_AESGCM_VERSION_BYTE_KEY"
#: the version byte's offset: right after the magic
VERSION_AT = 4


@pytest.fixture(autouse=True)
def key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, KEY.hex())


def _serde(**config: object) -> AesGcmSerde:
    return AesGcmSerde(msgspec.convert({"key_env": ENV, **config}, AesGcmConfig))


def _context(data: bytes) -> SerdeContext:
    return SerdeContext(suite_key(), len(data), record_layout=kv_layout(KV_SHAPE), chain=("aesgcm",))


def _with_version_byte(frame: bytes, version: int) -> bytes:
    damaged = bytearray(frame)
    damaged[VERSION_AT] = version
    return bytes(damaged)


@pytest.mark.parametrize("per_salt_keys", [False, True])
@pytest.mark.parametrize("damaged", [VERSION | 4, VERSION | 0x80, 0xFF])
def test_a_frame_of_this_release_with_a_damaged_version_byte_is_corrupt_not_newer(
    damaged: int, per_salt_keys: bool
) -> None:
    serde, data = _serde(per_salt_keys=per_salt_keys), kv_like_bf16(seed=21)
    context = _context(data)
    frame = bytes(serde.encode(memoryview(data), context))
    assert frame[VERSION_AT] == VERSION
    with pytest.raises(AesGcmDecodeError, match=f"version {VERSION} frame whose version byte is damaged"):
        serde.decode(memoryview(_with_version_byte(frame, damaged)), context)
    stats = serde.stats()
    assert stats["corrupt_frames"] == 1
    assert stats["newer_frames"] == 0
    assert stats["decrypted_objects"] == 0
    assert bytes(serde.decode(memoryview(frame), context)) == data  # the intact frame still reads


def test_a_version_2_frame_with_a_damaged_version_byte_is_corrupt_not_newer() -> None:
    serde, data = _serde(per_salt_keys=False), kv_like_bf16(seed=22)
    context = _context(data)
    layout = context.record_layout.encode("ascii")
    epoch, nonce = os.urandom(16), os.urandom(12)
    header = cipher_module._HEADER.pack(b"LTAG", 2, 0, len(layout), serde._key_check, epoch, nonce)
    associated = header + layout + len(data).to_bytes(8, "little") + suite_key().to_bytes()
    frame = header + layout + serde._cipher(serde._key_check, epoch, None).encrypt(nonce, data, associated)
    with pytest.raises(AesGcmDecodeError, match="version 2 frame whose version byte is damaged"):
        serde.decode(memoryview(_with_version_byte(frame, 6)), context)
    assert serde.stats()["corrupt_frames"] == 1
    assert serde.stats()["newer_frames"] == 0


def test_a_frame_that_does_not_authenticate_as_ours_is_newer_or_damaged() -> None:
    """A newer release's frame (here: authentic under its own version byte) and one of ours
    damaged beyond its version byte cannot be told apart: both are ``newer_frames``, and
    the reason claims neither cause alone."""
    serde, data = _serde(per_salt_keys=False), kv_like_bf16(seed=23)
    context = _context(data)
    epoch, nonce = os.urandom(16), os.urandom(12)
    header = cipher_module._HEADER.pack(b"LTAG", VERSION + 1, 0, 0, serde._key_check, epoch, nonce)
    associated = header + len(data).to_bytes(8, "little") + suite_key().to_bytes()
    newer = header + serde._cipher(serde._key_check, epoch, None).encrypt(nonce, data, associated)
    ours = bytearray(serde.encode(memoryview(data), context))
    ours[VERSION_AT] = VERSION + 1
    ours[HEADER_SIZE + 100] ^= 1
    for frame in (newer, bytes(ours)):
        with pytest.raises(AesGcmDecodeError, match="written by a newer release or damaged"):
            serde.decode(memoryview(frame), context)
    stats = serde.stats()
    assert stats["newer_frames"] == 2
    assert stats["corrupt_frames"] == 0
    assert stats["decrypted_objects"] == 0
