"""Frames of another release met by a server sharing a store during a rolling upgrade:
each is a miss counted and explained by its true cause (an older or a newer format), not
as tampering or damage, so an operator knows the misses go once objects are stored again."""

from __future__ import annotations

import os

import msgspec
import pytest
from lmcache_plugin_serde_aesgcm import AesGcmConfig
from lmcache_plugin_serde_aesgcm import cipher as cipher_module
from lmcache_plugin_serde_aesgcm.cipher import VERSION, AesGcmDecodeError, AesGcmSerde

from lmcache_tiers.plugin import SerdeContext
from lmcache_tiers.testing.serde import KV_SHAPE, kv_layout, kv_like_bf16, suite_key

KEY = bytes(range(40, 72))
ENV = "TIERS_TEST_AESGCM_UPGRADE_KEY"


@pytest.fixture(autouse=True)
def key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, KEY.hex())


def _serde() -> AesGcmSerde:
    return AesGcmSerde(msgspec.convert({"key_env": ENV, "per_salt_keys": False}, AesGcmConfig))


def _stated_layout(data: bytes) -> SerdeContext:
    return SerdeContext(suite_key(), len(data), record_layout=kv_layout(KV_SHAPE))


def _frame_of_version(serde: AesGcmSerde, data: bytes, version: int) -> bytes:
    """An authentic frame whose header names ``version``: the first releases wrote version
    1 (no layout, the u16 reserved), and a release after this one may write a version 4."""
    epoch, nonce = os.urandom(16), os.urandom(12)
    header = cipher_module._HEADER.pack(b"LTAG", version, 0, 0, serde._key_check, epoch, nonce)
    associated = header + len(data).to_bytes(8, "little") + suite_key().to_bytes()
    return header + serde._cipher(serde._key_check, epoch, None).encrypt(nonce, data, associated)


def test_a_version_1_frame_whose_record_states_a_layout_is_refused_as_an_older_format() -> None:
    """The first releases stated the layout in the record and wrote version 1 frames: after
    an upgrade those are misses, counted apart from tampered layouts."""
    serde, data = _serde(), kv_like_bf16(seed=11)
    frame = _frame_of_version(serde, data, 1)
    with pytest.raises(AesGcmDecodeError, match="version 1 frame, written by an older release"):
        serde.decode(memoryview(frame), _stated_layout(data))
    stats = serde.stats()
    assert stats["layoutless_frames_refused"] == 1
    assert stats["layout_mismatch"] == 0
    assert stats["decrypted_objects"] == 0


def test_a_frame_of_a_newer_version_is_refused_as_a_newer_format_not_as_corrupt() -> None:
    serde, data = _serde(), kv_like_bf16(seed=12)
    frame = _frame_of_version(serde, data, VERSION + 1)
    with pytest.raises(AesGcmDecodeError, match=f"version {VERSION + 1} frame, written by a newer release"):
        serde.decode(memoryview(frame), _stated_layout(data))
    stats = serde.stats()
    assert stats["newer_frames"] == 1
    assert stats["corrupt_frames"] == 0
    assert stats["decrypted_objects"] == 0
