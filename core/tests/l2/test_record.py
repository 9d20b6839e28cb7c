"""Record headers: round trip, and every kind of damage detected as a RecordError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.record import (
    PREFIX_SIZE,
    RecordChecksumError,
    RecordCorruptError,
    RecordError,
    RecordMismatchError,
    RecordVerdict,
    RecordVersionError,
    checksum,
    decode_header,
    decode_record,
    encode_header,
    header_length,
    record_verdict,
    verify_payload,
)

KEY = ObjectKey("llama", 7, b"\x01" * 32, 2, "tenant")
PAYLOAD = bytes(range(256)) * 40


def record(payload: bytes = PAYLOAD, **kwargs: object) -> bytearray:
    return bytearray(encode_header(KEY, payload, **kwargs) + payload)  # type: ignore[arg-type]


def test_round_trip_keeps_every_field() -> None:
    data = record(l1_size=20480, serde=("fp8", "zstd"), layout="bf16[2,256,8,128]")
    header, payload = decode_record(data, expected_key=KEY, expected_serde=("fp8", "zstd"))
    assert header.key == KEY
    assert header.payload_len == len(PAYLOAD)
    assert header.l1_size == 20480
    assert header.serde == ("fp8", "zstd")
    assert header.layout == "bf16[2,256,8,128]"
    assert header.checksum == checksum(PAYLOAD)
    assert bytes(payload) == PAYLOAD


def test_l1_size_defaults_to_payload_length_and_empty_chain() -> None:
    header = decode_header(record())
    assert header.l1_size == len(PAYLOAD)
    assert header.serde == ()


def test_header_length_is_readable_from_the_prefix_and_alignment_applies() -> None:
    data = record(align=4096)
    assert header_length(data[:PREFIX_SIZE]) == 4096
    header, payload = decode_record(data)
    assert header.header_len == 4096 and bytes(payload) == PAYLOAD


def test_payload_bit_flip_is_a_checksum_error() -> None:
    data = record()
    data[-100] ^= 0x01
    with pytest.raises(RecordChecksumError):
        decode_record(data)


def test_truncated_payload_is_a_checksum_error() -> None:
    data = record()
    with pytest.raises(RecordChecksumError):
        decode_record(data[:-1])


@pytest.mark.parametrize("offset", [20, 30, PREFIX_SIZE + 3])
def test_header_bit_flip_is_detected_by_the_header_crc(offset: int) -> None:
    data = record()
    data[offset] ^= 0x40
    with pytest.raises(RecordCorruptError):
        decode_header(data)


def test_bad_magic_truncation_and_absurd_lengths() -> None:
    data = record()
    with pytest.raises(RecordCorruptError, match="magic"):
        decode_header(b"XXXX" + bytes(data[4:]))
    with pytest.raises(RecordCorruptError):
        decode_header(data[:10])
    header_len = header_length(data)
    with pytest.raises(RecordCorruptError, match="truncated"):
        decode_header(data[: header_len - 1])
    bogus = bytearray(data)
    bogus[8:12] = (1 << 30).to_bytes(4, "little")
    with pytest.raises(RecordCorruptError, match="implausible"):
        decode_header(bogus)


def as_version(data: bytearray, version: int) -> bytearray:
    """``data`` (a whole record) as a record of format ``version`` that is intact: its
    header crc taken again, as the server writing that version takes it."""
    import zlib

    newer = bytearray(data)
    newer[4:6] = version.to_bytes(2, "little")
    crc_at = header_length(data) - 4
    newer[crc_at : crc_at + 4] = zlib.crc32(bytes(newer[:crc_at])).to_bytes(4, "little")
    return newer


def test_other_version_is_refused() -> None:
    with pytest.raises(RecordVersionError):
        decode_header(as_version(record(), 99))


@pytest.mark.parametrize("bit", range(16))
def test_a_version_field_a_flipped_bit_changed_is_damage_not_another_version(bit: int) -> None:
    # A record of this release whose version field a flipped bit changed (1 -> 0, 3, 5,
    # 9, ...) is told from one another version wrote by its header crc alone: it is damage,
    # removed, not a newer server's record kept until replaced.
    data = record(align=4096)
    data[4 + bit // 8] ^= 1 << bit % 8
    assert header_length(data[:PREFIX_SIZE]) == 4096, "the rest of the header is read to judge it"
    with pytest.raises(RecordCorruptError, match="crc") as raised:
        decode_header(data, expected_key=KEY)
    assert record_verdict(raised.value) is RecordVerdict.DAMAGED


@pytest.mark.parametrize("version", [0, 2, 3, 0xFFFF])
def test_an_intact_record_of_another_version_is_kept_even_with_damage_after_its_crc(version: int) -> None:
    data = as_version(record(), version)
    data[-1] ^= 1  # the payload: another version's business, not read here
    with pytest.raises(RecordVersionError) as raised:
        decode_header(data, expected_key=KEY)
    assert record_verdict(raised.value) is RecordVerdict.NEWER


def test_another_version_whose_header_was_not_read_whole_is_kept() -> None:
    # A newer format's header may be longer than this release reads for a key (a fixed
    # header read): its crc cannot be taken, and removing an intact record another server
    # reads would lose its write, so it is kept as a newer server's.
    data = as_version(record(align=4096), 2)
    with pytest.raises(RecordVersionError, match="not read whole") as raised:
        decode_header(data[:512], expected_key=KEY)
    assert record_verdict(raised.value) is RecordVerdict.NEWER


def test_other_key_or_serde_chain_is_a_mismatch() -> None:
    data = record(serde=("zstd",))
    other = ObjectKey("llama", 7, b"\x02" * 32, 2, "tenant")
    with pytest.raises(RecordMismatchError, match="holds key"):
        decode_header(data, expected_key=other)
    with pytest.raises(RecordMismatchError, match="serde chain"):
        decode_header(data, expected_serde=())
    assert issubclass(RecordMismatchError, RecordError)


def test_verify_payload_checks_length_and_digest() -> None:
    header = decode_header(record())
    verify_payload(header, PAYLOAD)
    with pytest.raises(RecordChecksumError):
        verify_payload(header, PAYLOAD[::-1])


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        encode_header(KEY, PAYLOAD, align=0)
    with pytest.raises(ValueError):
        encode_header(KEY, PAYLOAD, serde=("a,b",))


@settings(deadline=None)  # a loaded CI machine must not turn slowness into failure
@given(
    payload=st.binary(max_size=2048),
    salt=st.text(alphabet="abcxyz-_", max_size=20),
    serde=st.lists(st.text(alphabet="abcdefgh0123456789_", min_size=1, max_size=10), max_size=4),
    align=st.sampled_from([1, 8, 512, 4096]),
)
def test_any_record_round_trips(payload: bytes, salt: str, serde: list[str], align: int) -> None:
    key = ObjectKey("m", 1, b"\xab" * 16, 0, salt)
    data = encode_header(key, payload, serde=serde, align=align) + payload
    header, body = decode_record(data, expected_key=key, expected_serde=serde)
    assert header.header_len % align == 0
    assert bytes(body) == payload


def test_records_written_with_blake3_still_verify() -> None:
    """Algorithm 1 (blake3) was the first checksum; such records must stay readable."""
    import struct
    import zlib

    from lmcache_tiers.l2 import record

    key = ObjectKey("m", 0, b"\x01" * 32)
    payload = b"kv" * 1000
    header = bytearray(record.encode_header(key, payload))
    algo_offset = struct.calcsize("<4sHHIQQ")
    digest_offset = algo_offset + 4
    header[algo_offset] = record.CHECKSUM_BLAKE3_128
    header[digest_offset : digest_offset + 16] = record.checksum(payload, record.CHECKSUM_BLAKE3_128)
    crc_at = len(header) - 4
    header[crc_at:] = struct.pack("<I", zlib.crc32(bytes(header[:crc_at])))
    decoded = record.decode_header(bytes(header))
    assert decoded.checksum_algo == record.CHECKSUM_BLAKE3_128
    record.verify_payload(decoded, payload)
    with pytest.raises(record.RecordChecksumError):
        record.verify_payload(decoded, b"kV" * 1000)


@pytest.mark.parametrize("algo", ["xxh3", "blake3"])
@pytest.mark.parametrize("piece", [1, 7, 4096, len(PAYLOAD)])
def test_payload_verifier_agrees_with_verify_payload_piece_by_piece(algo: str, piece: int) -> None:
    from lmcache_tiers.l2 import record

    header = decode_header(record.encode_header(KEY, PAYLOAD))
    if algo == "blake3":
        header = header._replace(
            checksum_algo=record.CHECKSUM_BLAKE3_128,
            checksum=checksum(PAYLOAD, record.CHECKSUM_BLAKE3_128),
        )

    def verify(payload: bytes) -> None:
        verifier = record.PayloadVerifier(header)
        for start in range(0, len(payload), piece):
            verifier.update(memoryview(payload)[start : start + piece])
        verifier.verify()

    verify(PAYLOAD)
    record.verify_payload(header, PAYLOAD)
    flipped = bytearray(PAYLOAD)
    flipped[len(PAYLOAD) // 2] ^= 1
    for damaged in (bytes(flipped), PAYLOAD[:-1], PAYLOAD + b"\0"):
        with pytest.raises(RecordChecksumError):
            verify(damaged)


def _spec_header(key: ObjectKey, payload: bytes, serde: tuple[str, ...], layout: str, align: int) -> bytes:
    """A header packed field by field as the format (record.py's docstring) lays it out,
    independently of encode_header: what files written by earlier versions hold."""
    import struct
    import zlib

    key_bytes, layout_bytes, serde_bytes = key.to_bytes(), layout.encode(), ",".join(serde).encode()
    fields_len = struct.calcsize("<4sHHIQQB3x16sHHH") + len(key_bytes) + len(layout_bytes) + len(serde_bytes)
    header_len = -(-(fields_len + 4) // align) * align
    body = struct.pack(
        "<4sHHIQQB3x16sHHH",
        b"LMTR",
        1,
        0,
        header_len,
        len(payload),
        3 * len(payload),
        2,
        checksum(payload),
        len(key_bytes),
        len(layout_bytes),
        len(serde_bytes),
    )
    body += key_bytes + layout_bytes + serde_bytes
    body += bytes(header_len - 4 - len(body))
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("align", [1, 512, 4096])
def test_headers_of_the_documented_format_decode_and_encode_byte_for_byte(align: int) -> None:
    serde, layout = ("fp8", "zstd"), "bf16[2,256,8,128]"
    spec = _spec_header(KEY, PAYLOAD, serde, layout, align)
    assert (
        encode_header(KEY, PAYLOAD, l1_size=3 * len(PAYLOAD), serde=serde, layout=layout, align=align) == spec
    )
    for expected_serde in (serde, list(serde), None):
        header = decode_header(spec, expected_key=KEY, expected_serde=expected_serde)
        assert (header.key, header.serde, header.layout) == (KEY, serde, layout)
        assert (header.payload_len, header.l1_size, header.header_len) == (
            len(PAYLOAD),
            3 * len(PAYLOAD),
            len(spec),
        )
        assert header.checksum == checksum(PAYLOAD)


def test_every_byte_of_an_aligned_header_is_covered_by_its_crc() -> None:
    data = record(align=4096, serde=("zstd",))
    for offset in [0, 12, 40, PREFIX_SIZE, PREFIX_SIZE + 5, 300, 2048, 4090, 4093]:
        damaged = bytearray(data)
        damaged[offset] ^= 0x08
        with pytest.raises(RecordError):
            decode_header(damaged, expected_key=KEY, expected_serde=("zstd",))


def test_padding_that_is_not_zero_is_judged_by_the_crc_alone() -> None:
    """Encoders write zero padding; a header whose padding is not zero but whose crc
    covers it is accepted, as it always was (the crc is what defines an intact header)."""
    import struct
    import zlib

    data = bytearray(encode_header(KEY, PAYLOAD, align=4096))
    data[3000] = 0x5A
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    assert decode_header(data, expected_key=KEY, expected_serde=()).header_len == 4096


def test_a_key_or_chain_of_the_same_encoded_length_is_still_a_mismatch() -> None:
    data = record(align=4096, serde=("zstd",))
    same_length = ObjectKey("llama", 7, b"\x01" * 31 + b"\x02", 2, "tenant")
    assert len(same_length.to_bytes()) == len(KEY.to_bytes())
    with pytest.raises(RecordMismatchError, match="holds key"):
        decode_header(data, expected_key=same_length, expected_serde=("zstd",))
    from lmcache_tiers.l2.record import RecordSerdeMismatchError

    for chain in (("lz4x",), ["lz4x"], ()):
        with pytest.raises(RecordSerdeMismatchError):
            decode_header(data, expected_key=KEY, expected_serde=chain)


@settings(deadline=None)
@given(
    body=st.binary(max_size=600),
    padding=st.integers(min_value=0, max_value=5000),
    flip=st.one_of(st.none(), st.integers(min_value=0)),
)
def test_crc_of_a_zero_padded_range_is_zlibs(body: bytes, padding: int, flip: int | None) -> None:
    import zlib

    from lmcache_tiers.l2.headercrc import crc32_zero_padded

    data = bytearray(body + bytes(padding) + b"tail")
    if flip is not None and padding:
        data[len(body) + flip % padding] = 0x80  # padding that is not all zeros
    end = len(body) + padding
    assert crc32_zero_padded(memoryview(data), len(body), end) == zlib.crc32(data[:end])


@pytest.mark.parametrize("key_len", [0, 1, 5, len(KEY.to_bytes()) - 1])
def test_a_key_field_that_is_no_key_is_corrupt_even_under_a_valid_crc(key_len: int) -> None:
    """A header whose crc holds but whose key bytes do not decode (a foreign or buggy
    writer) is a damaged record, never another exception: backends remove RecordErrors,
    anything else fails every batch the key is in, for good."""
    import struct
    import zlib

    data = bytearray(encode_header(KEY, PAYLOAD, align=4096))
    struct.pack_into("<H", data, PREFIX_SIZE - 6, key_len)
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    for expected in (KEY, None):
        with pytest.raises(RecordCorruptError, match="invalid"):
            decode_header(data, expected_key=expected)


def test_every_record_error_has_one_verdict_kept_or_removed() -> None:
    """The one rule of header reads: another key's intact record and a newer format's are
    kept (their writers read them); anything else that fails decoding is damage."""
    key, other = ObjectKey("m", 0, b"\x01" * 32), ObjectKey("m", 0, b"\x02" * 32)
    header = encode_header(key, b"payload")
    newer = as_version(bytearray(header), 99)
    flipped = bytearray(header)
    flipped[-1] ^= 1

    def verdict(data: bytes | bytearray, expected: ObjectKey = key) -> RecordVerdict:
        with pytest.raises(RecordError) as raised:
            decode_header(data, expected_key=expected)
        return record_verdict(raised.value)

    assert verdict(header, other) is RecordVerdict.FOREIGN
    assert verdict(newer) is RecordVerdict.NEWER
    assert verdict(flipped) is verdict(header[:10]) is RecordVerdict.DAMAGED
    assert [v.kept for v in RecordVerdict] == [True, True, False]
    assert [v.counter for v in RecordVerdict] == [
        "foreign_records",
        "record_version_unknown",
        "corrupt_records_removed",
    ]


def _verdict_of(data: bytes | bytearray, key: ObjectKey, serde: list[str]) -> RecordVerdict | None:
    """The verdict on ``data`` read back for ``key`` (None: it decodes, served)."""
    try:
        decode_header(data, expected_key=key, expected_serde=tuple(serde))
    except RecordError as exc:
        return record_verdict(exc)
    return None


@settings(deadline=None, max_examples=300)
@given(
    payload_len=st.integers(min_value=0, max_value=5000),
    salt=st.text(alphabet="abcxyz-_.", max_size=60),
    serde=st.lists(st.text(alphabet="abcdefgh0123456789_", min_size=1, max_size=12), max_size=4),
    layout=st.text(alphabet="bf16[],0123456789", max_size=40),
    align=st.sampled_from([1, 7, 8, 512, 4096, 8192]),
    other_version=st.integers(min_value=0, max_value=0xFFFF).filter(lambda v: v != 1),
    version_bit=st.integers(min_value=0, max_value=15),
    extra=st.integers(min_value=0, max_value=9000),
    short=st.integers(min_value=1, max_value=1 << 16),
)
def test_no_intact_record_of_any_size_chain_or_version_is_judged_damaged(
    payload_len: int,
    salt: str,
    serde: list[str],
    layout: str,
    align: int,
    other_version: int,
    version_bit: int,
    extra: int,
    short: int,
) -> None:
    """Removing a record judged damaged loses its write: across record sizes, chains,
    layouts and alignments (the crc's zero-padding fast path and zlib both), a record of
    this version read with its whole header is served, and an intact one of another
    version is kept (NEWER) however much of it was read -- its crc taken when the header
    was read whole, kept unread otherwise.  Only this version's record whose version field
    a flipped bit changed, read whole, is damage."""
    key = ObjectKey("m", 3, b"\xcd" * 32, 1, salt)
    payload = bytes(range(256)) * (payload_len // 256) + bytes(payload_len % 256)
    data = bytearray(encode_header(key, payload, serde=serde, layout=layout, align=align) + payload)
    header_len = header_length(data[:PREFIX_SIZE])
    # this version, read exactly to the header's end or past it (a fixed-size header read)
    assert _verdict_of(data[: header_len + extra % (payload_len + 1)], key, serde) is None
    # another version's intact record: header_length does not judge it; never removed
    newer = as_version(data, other_version)
    assert header_length(newer[:PREFIX_SIZE]) == header_len
    read = header_len + extra % (payload_len + 1) if short % 2 else PREFIX_SIZE + short % header_len
    assert _verdict_of(newer[:read], key, serde) is RecordVerdict.NEWER
    # this version's record whose version field a flipped bit changed, read whole: damage
    flipped = bytearray(data)
    flipped[4 + version_bit // 8] ^= 1 << version_bit % 8
    assert _verdict_of(flipped[: header_len + extra % (payload_len + 1)], key, serde) is RecordVerdict.DAMAGED
