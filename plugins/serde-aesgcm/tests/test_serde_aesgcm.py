"""The aesgcm serde: the conformance suite, keys, frames and what decode refuses."""

from __future__ import annotations

import base64
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from lmcache_plugin_serde_aesgcm import AesGcmConfig
from lmcache_plugin_serde_aesgcm import cipher as cipher_module
from lmcache_plugin_serde_aesgcm.cipher import HEADER_SIZE, TAG_SIZE, AesGcmDecodeError, AesGcmSerde
from lmcache_plugin_serde_zstd.codec import ZstdSerde

from lmcache_tiers.l2.codec import SerdeChain
from lmcache_tiers.plugin import MAX_LAYOUT_LEN, ConfigError, SerdeContext
from lmcache_tiers.testing.serde import (
    BINDS_KEY,
    DETECTS_CORRUPTION,
    KV_SHAPE,
    LOSSLESS,
    SerdeSuite,
    kv_layout,
    kv_like_bf16,
    suite_key,
)

KEY = bytes(range(1, 33))
ENV = "TIERS_TEST_AESGCM_KEY"


@pytest.fixture(autouse=True)
def key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, KEY.hex())


class TestAesGcmSerde(SerdeSuite):
    component_name = "aesgcm"
    capabilities = frozenset({LOSSLESS, DETECTS_CORRUPTION, BINDS_KEY})

    def make_config(self) -> AesGcmConfig:
        return AesGcmConfig(key_env=ENV)


class TestAesGcmSharedKeyFromFile(SerdeSuite):
    component_name = "aesgcm"
    capabilities = frozenset({LOSSLESS, DETECTS_CORRUPTION, BINDS_KEY})

    @pytest.fixture(autouse=True)
    def key_file(self, tmp_path: Path) -> Iterator[None]:
        path = tmp_path / "key"
        path.write_bytes(KEY)
        path.chmod(0o600)
        self.path = str(path)
        yield

    def make_config(self) -> AesGcmConfig:
        return AesGcmConfig(key_file=self.path, per_salt_keys=False)


def _serde(**config: object) -> AesGcmSerde:
    return AesGcmSerde(msgspec.convert({"key_env": ENV, **config}, AesGcmConfig))


def _round(serde: AesGcmSerde, data: bytes, key: object = None) -> tuple[bytes, SerdeContext]:
    context = SerdeContext(key or suite_key(), len(data), kv_layout(KV_SHAPE))  # type: ignore[arg-type]
    return bytes(serde.encode(memoryview(data), context)), context


def test_frame_is_ciphertext_of_the_right_size() -> None:
    data = kv_like_bf16()
    frame, _ = _round(_serde(), data)
    assert len(frame) == HEADER_SIZE + len(data) + TAG_SIZE
    assert len(frame) + MAX_LAYOUT_LEN == _serde().max_encoded_size(len(data))
    assert frame[:4] == b"LTAG"
    assert data[1000:1032] not in frame


def _with_record_layout(serde: AesGcmSerde, data: bytes, layout: str) -> bytes:
    context = SerdeContext(suite_key(), len(data), record_layout=layout)
    return bytes(serde.encode(memoryview(data), context))


def test_the_layout_a_record_states_is_bound() -> None:
    # Core's record header states the layout a loaded object gets in L1 outside any serde:
    # a frame carries its own authenticated copy, and a record stating another is refused.
    serde, data = _serde(), kv_like_bf16(seed=6)
    layout = kv_layout(KV_SHAPE)
    frame = _with_record_layout(serde, data, layout)
    assert len(frame) == HEADER_SIZE + len(layout) + len(data) + TAG_SIZE
    for stated in (layout, ""):  # "": an adapter that keeps no layout states none
        back = serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data), record_layout=stated))
        assert bytes(back) == data
    forged = layout.replace("bfloat16", "float16")
    with pytest.raises(AesGcmDecodeError, match="states layout"):
        serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data), record_layout=forged))
    assert serde.stats()["layout_mismatch"] == 1
    # The frame's own copy changed to match a forged record: authentication fails.
    swapped = layout.replace("[2,4,", "[4,2,")
    assert swapped != layout and len(swapped) == len(layout)
    tampered = frame.replace(layout.encode(), swapped.encode())
    with pytest.raises(AesGcmDecodeError, match="authentication failed"):
        serde.decode(memoryview(tampered), SerdeContext(suite_key(), len(data), record_layout=swapped))
    # A layout length past the frame is a corrupt frame, not a read past it.
    short = bytearray(frame[: HEADER_SIZE + 8])
    with pytest.raises(AesGcmDecodeError, match="layout of"):
        serde.decode(memoryview(short + bytes(TAG_SIZE - 8)), SerdeContext(suite_key(), len(data)))


def _v1_frame(serde: AesGcmSerde, data: bytes) -> bytes:
    """A frame as version 1 wrote it: no layout, the u16 reserved."""
    epoch, nonce = os.urandom(16), os.urandom(12)
    header = cipher_module._HEADER.pack(b"LTAG", 1, 0, 0, serde._key_check, epoch, nonce)
    associated = header + len(data).to_bytes(8, "little") + suite_key().to_bytes()
    return header + serde._cipher(serde._key_check, epoch, None).encrypt(nonce, data, associated)


def test_version_1_frames_are_read_where_their_record_states_no_layout() -> None:
    serde, data = _serde(per_salt_keys=False), kv_like_bf16(seed=7)
    frame = _v1_frame(serde, data)
    assert bytes(serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data)))) == data
    stated = SerdeContext(suite_key(), len(data), record_layout=kv_layout(KV_SHAPE))
    with pytest.raises(AesGcmDecodeError, match="cannot vouch for the layout"):
        serde.decode(memoryview(frame), stated)  # v1 binds none: the stated one is unproven
    assert serde.stats()["layoutless_frames_refused"] == 1


def test_every_encryption_uses_a_fresh_nonce() -> None:
    serde = _serde()
    data = b"same object" * 100
    frames = [_round(serde, data)[0] for _ in range(2000)]
    nonces = {frame[HEADER_SIZE - 12 : HEADER_SIZE] for frame in frames}
    assert len(nonces) == len(frames)
    assert len({frame[HEADER_SIZE:] for frame in frames}) == len(frames)


def test_epochs_rotate_and_old_frames_still_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cipher_module, "EPOCH_OBJECTS", 3)
    serde = _serde()
    data = kv_like_bf16(seed=1)
    frames = [_round(serde, data) for _ in range(7)]
    assert serde.stats()["key_epochs"] == 3
    assert len({frame[16:32] for frame, _ in frames}) == 3  # the epoch field
    reader = _serde()  # another process with the same master key
    for frame, context in frames:
        assert bytes(reader.decode(memoryview(frame), context)) == data


def test_tenants_get_different_keys_and_either_setting_reads_both() -> None:
    data = kv_like_bf16(seed=2)
    per_salt, shared = _serde(per_salt_keys=True), _serde(per_salt_keys=False)
    for writer in (per_salt, shared):
        frame, context = _round(writer, data, suite_key(1, salt="tenant-a"))
        for reader in (per_salt, shared):
            assert bytes(reader.decode(memoryview(frame), context)) == data
    # Same epoch, same nonce, same plaintext and key bytes: only the derived key differs.
    a = per_salt._cipher(per_salt._key_check, b"e" * 16, "tenant-a")
    b = per_salt._cipher(per_salt._key_check, b"e" * 16, "tenant-b")
    assert a.encrypt(b"n" * 12, b"x" * 64, None) != b.encrypt(b"n" * 12, b"x" * 64, None)


def test_a_frame_copied_under_another_key_fails_to_decrypt() -> None:
    serde = _serde()
    data = kv_like_bf16(seed=3)
    frame, _ = _round(serde, data, suite_key(1))
    with pytest.raises(AesGcmDecodeError, match="authentication failed"):
        serde.decode(memoryview(frame), SerdeContext(suite_key(2), len(data)))
    assert serde.stats()["auth_failures"] == 1


def test_another_master_key_is_reported_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    data = kv_like_bf16(seed=4)
    frame, context = _round(_serde(), data)
    monkeypatch.setenv(ENV, os.urandom(32).hex())
    other = _serde()
    with pytest.raises(AesGcmDecodeError, match="another master key"):
        other.decode(memoryview(frame), context)
    assert other.stats()["wrong_key"] == 1


def test_tampered_header_fields_fail_authentication() -> None:
    serde = _serde()
    data = kv_like_bf16(seed=5)
    frame, context = _round(serde, data)
    # per-salt flag cleared, unknown flag set, epoch and nonce bits flipped
    for position, mask, counter in (
        (5, 0x01, "auth_failures"),
        (5, 0x02, "corrupt_frames"),
        (20, 0x01, "auth_failures"),
        (40, 0x80, "auth_failures"),
    ):
        damaged = bytearray(frame)
        damaged[position] ^= mask
        before = serde.stats()[counter]
        with pytest.raises(AesGcmDecodeError):
            serde.decode(memoryview(damaged), context)
        assert serde.stats()[counter] == before + 1, (position, mask)


def test_repr_and_errors_never_show_the_key() -> None:
    serde = _serde()
    assert KEY.hex() not in repr(serde) and ENV in repr(serde)
    frame, context = _round(serde, b"x" * 100)
    try:
        serde.decode(memoryview(frame[:-1]), context)
    except AesGcmDecodeError as exc:
        assert KEY.hex() not in str(exc)


# -- key sources -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        KEY,
        KEY.hex().encode(),
        KEY.hex().encode() + b"\n",
        base64.b64encode(KEY),
        base64.b64encode(KEY) + b"\r\n",
    ],
    ids=["raw", "hex", "hex-newline", "base64", "base64-crlf"],
)
def test_key_file_encodings(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    path.chmod(0o600)
    frame, context = _round(AesGcmSerde(AesGcmConfig(key_file=str(path))), b"payload")
    assert bytes(_serde().decode(memoryview(frame), context)) == b"payload"  # same key as ENV


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (KEY[:16], "found 16 bytes"),
        (KEY + b"!", "found 33 bytes"),
        # only the text forms may end in a newline: 32 raw bytes are the whole file
        (KEY + b"\n", "found 33 bytes"),
        (b"zz" * 32, "found 64 bytes"),
        (bytes(32), "all-zero"),
        (b"k" * 5000, "larger than 4096"),
        # 32 characters of text are not 32 random bytes: hex of a 128-bit key, a passphrase
        (KEY[:16].hex().encode(), "32 characters of text"),
        (b"correct horse battery staple 123", "32 characters of text"),
    ],
)
def test_bad_key_files_are_one_line_config_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as raised:
        AesGcmSerde(AesGcmConfig(key_file=str(path)))
    text = str(raised.value)
    assert "\n" not in text and str(path) in text
    assert content.hex() not in text and repr(content) not in text


def test_missing_and_unreadable_key_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read: No such file"):
        AesGcmSerde(AesGcmConfig(key_file=str(tmp_path / "absent")))
    with pytest.raises(ConfigError, match="cannot be read: Is a directory"):
        AesGcmSerde(AesGcmConfig(key_file=str(tmp_path)))


def test_a_key_file_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """Opening a FIFO blocks until someone writes to it: start-up would hang, not stop with
    one line."""
    path = tmp_path / "key"
    os.mkfifo(path, 0o600)
    outcome: list[BaseException | None] = []

    def build() -> None:
        try:
            AesGcmSerde(AesGcmConfig(key_file=str(path)))
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(5)
    waiting = thread.is_alive()
    if waiting:  # blocked in open(): opening the writer end lets it go
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    assert not waiting, "start-up waited for a writer to open the FIFO"
    assert outcome and isinstance(outcome[0], ConfigError) and "not a regular file" in str(outcome[0])


def test_loose_key_file_mode_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "key"
    path.write_bytes(KEY)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, "lmcache_tiers.serde.aesgcm"):
        AesGcmSerde(AesGcmConfig(key_file=str(path)))
    assert "chmod 600" in caplog.text and "644" in caplog.text
    assert KEY.hex() not in caplog.text


def test_key_environment_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV)
    with pytest.raises(ConfigError, match=f"environment variable {ENV} is not set"):
        _serde()
    monkeypatch.setenv(ENV, KEY.hex()[:40])
    with pytest.raises(ConfigError, match="found 40 characters") as raised:
        _serde()
    assert KEY.hex()[:40] not in str(raised.value)


def test_an_environment_key_error_names_only_the_encodings_a_variable_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A variable is read as hex or base64 only: its refusal must not invite 32 raw bytes,
    which a variable cannot hold (no NUL) and which would be refused again."""
    monkeypatch.setenv(ENV, "x" * 32)
    with pytest.raises(
        ConfigError, match="expected 64 hex digits or base64 of 32 bytes; found 32 characters"
    ) as raised:
        _serde()
    assert "raw bytes" not in str(raised.value)


def test_config_needs_exactly_one_key_source() -> None:
    for fields in ({}, {"key_file": "/k", "key_env": ENV}):
        with pytest.raises(msgspec.ValidationError, match="exactly one of key_file or key_env"):
            msgspec.convert(fields, AesGcmConfig)
    with pytest.raises(msgspec.ValidationError, match="not an environment variable name"):
        msgspec.convert({"key_env": "A-B"}, AesGcmConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"key_env": ENV, "key": KEY.hex()}, AesGcmConfig)


def test_hex_with_spaces_is_no_256_bit_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 characters of hex in groups ("0102 0304 ...") hold only 26 bytes: a short key is
    refused with one line, never used as the master key (nor an assertion at start-up)."""
    grouped = " ".join(KEY[:26].hex()[i : i + 4] for i in range(0, 52, 4))
    assert len(grouped) == 64
    path = tmp_path / "key"
    path.write_bytes(grouped.encode())
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="found 64 bytes"):
        AesGcmSerde(AesGcmConfig(key_file=str(path)))
    monkeypatch.setenv(ENV, grouped)
    with pytest.raises(ConfigError, match="found 64 characters"):
        _serde()


def _adapter_chain(*serdes: object) -> SerdeChain:
    return SerdeChain(serdes)  # type: ignore[arg-type]


def test_a_record_whose_chain_was_rewritten_is_refused() -> None:
    # Two adapters share a store and a master key: one encodes [zstd, aesgcm], the other
    # [aesgcm].  Someone who can write the store rewrites a record of the first to name
    # the chain "aesgcm" and an L1 size of the zstd frame's length; the record header
    # checks then pass on the second adapter, which applies its chain as core does.  The
    # decrypted zstd frame must not come back as the object.
    data = kv_like_bf16(seed=9)
    compressing = _adapter_chain(ZstdSerde(), _serde())
    plain_serde = _serde()
    plain = _adapter_chain(plain_serde)
    staged = compressing.encode(suite_key(), memoryview(data), kv_layout(KV_SHAPE))
    payload = bytes(staged.view)
    staged.release()
    inner_context = SerdeContext(suite_key(), len(data), kv_layout(KV_SHAPE))
    inner = bytes(ZstdSerde().encode(memoryview(data), inner_context))
    target = bytearray(len(inner))  # the forged record's l1_size: the zstd frame's length
    with pytest.raises(AesGcmDecodeError, match="authentication failed"):
        plain.decode_into(suite_key(), memoryview(payload), memoryview(target), kv_layout(KV_SHAPE))
    assert plain_serde.stats()["auth_failures"] == 1
    assert bytes(target) != inner
    # Each adapter still reads what it wrote itself.
    back = bytearray(len(data))
    compressing.decode_into(suite_key(), memoryview(payload), memoryview(back), kv_layout(KV_SHAPE))
    assert bytes(back) == data


def _v2_frame(serde: AesGcmSerde, data: bytes, layout: str) -> bytes:
    """A frame as version 2 wrote it: the layout bound, the chain not."""
    epoch, nonce = os.urandom(16), os.urandom(12)
    header = cipher_module._HEADER.pack(b"LTAG", 2, 0, len(layout), serde._key_check, epoch, nonce)
    associated = header + layout.encode() + len(data).to_bytes(8, "little") + suite_key().to_bytes()
    return (
        header
        + layout.encode()
        + serde._cipher(serde._key_check, epoch, None).encrypt(nonce, data, associated)
    )


def test_version_2_frames_are_read_and_counted_unless_refused_by_config() -> None:
    data, layout = kv_like_bf16(seed=10), kv_layout(KV_SHAPE)
    stated = SerdeContext(suite_key(), len(data), record_layout=layout, chain=("aesgcm",))
    reader = _serde(per_salt_keys=False)
    frame = _v2_frame(reader, data, layout)
    assert bytes(reader.decode(memoryview(frame), stated)) == data
    assert reader.stats()["unbound_frames_read"] == 1
    strict = _serde(per_salt_keys=False, read_unbound_frames=False)
    with pytest.raises(AesGcmDecodeError, match="does not bind the serde chain"):
        strict.decode(memoryview(frame), stated)
    with pytest.raises(AesGcmDecodeError, match="does not bind the serde chain"):
        strict.decode(memoryview(_v1_frame(strict, data)), SerdeContext(suite_key(), len(data)))
    assert strict.stats()["unbound_frames_refused"] == 2
    assert strict.stats()["decrypted_objects"] == 0


def test_the_chain_and_position_are_bound() -> None:
    serde, data = _serde(), kv_like_bf16(seed=11)
    written = SerdeContext(suite_key(), len(data), chain=("zstd", "aesgcm"), position=1)
    frame = bytes(serde.encode(memoryview(data), written))
    assert frame[4] == 3  # the version that binds the chain
    assert bytes(serde.decode(memoryview(frame), written)) == data
    for chain, position in ((("aesgcm",), 0), (("zstd", "aesgcm"), 0), (("zstd,aesgcm",), 0), ((), 0)):
        other = SerdeContext(suite_key(), len(data), chain=chain, position=position)
        # The reason the adapter logs names the chain as a cause, not only tampering.
        with pytest.raises(AesGcmDecodeError, match=r"authentication failed.*another serde chain"):
            serde.decode(memoryview(frame), other)
    assert serde.stats()["unbound_frames_read"] == 0


def _key_file(tmp_path: Path, name: str, key: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(key.hex().encode() + b"\n")
    path.chmod(0o600)
    return str(path)


def test_a_rotated_key_kept_for_reading_decrypts_frames_written_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart after a key rotation: frames written under the retired key still decode
    (counted), new frames are written under the new key only, and a server not given the
    retired key counts them as wrong_key, as before."""
    data = kv_like_bf16(seed=11)
    old_frame, context = _round(_serde(), data)  # written under KEY, from ENV
    new_key = os.urandom(32)
    rotated = AesGcmSerde(AesGcmConfig(key_file=_key_file(tmp_path, "new.key", new_key), read_key_envs=[ENV]))
    assert bytes(rotated.decode(memoryview(old_frame), context)) == data
    assert rotated.stats()["retired_key_frames_read"] == 1
    new_frame, _ = _round(rotated, data)
    monkeypatch.setenv(ENV, os.urandom(32).hex())  # the retired key is gone for good
    new_only = AesGcmSerde(AesGcmConfig(key_file=_key_file(tmp_path, "new-only.key", new_key)))
    assert bytes(new_only.decode(memoryview(new_frame), context)) == data
    with pytest.raises(AesGcmDecodeError, match="another master key"):
        new_only.decode(memoryview(old_frame), context)
    assert new_only.stats()["wrong_key"] == 1
    assert new_only.stats()["retired_key_frames_read"] == 0
    retired_file = AesGcmSerde(
        AesGcmConfig(
            key_file=_key_file(tmp_path, "n.key", new_key), read_key_files=[_key_file(tmp_path, "o.key", KEY)]
        )
    )
    assert bytes(retired_file.decode(memoryview(old_frame), context)) == data


def test_retired_keys_are_checked_like_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="read_key_files"):
        AesGcmSerde(AesGcmConfig(key_env=ENV, read_key_files=[str(tmp_path / "missing.key")]))
    with pytest.raises(ValueError, match="read_key_envs holds a 256-bit key itself") as raised:
        AesGcmConfig(key_env=ENV, read_key_envs=[KEY.hex()])
    assert KEY.hex() not in str(raised.value)
