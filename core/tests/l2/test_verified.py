"""Payloads moved and checksummed in one pass (l2/verified.py): a byte is handed out only
after the whole payload matched its header, whatever piece the damage is in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import verified
from lmcache_tiers.l2.record import (
    CHECKSUM_BLAKE3_128,
    RecordChecksumError,
    RecordCorruptError,
    RecordHeader,
    checksum,
    decode_header,
    encode_header,
)
from lmcache_tiers.l2.verified import copy_and_checksum, copy_verified, read_record_file

KEY = ObjectKey("llama", 3, b"\x07" * 32, 1, "tenant")
PIECE = 4096  # small pieces: every payload below is several


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verified, "VERIFY_PIECE", PIECE)
    monkeypatch.setattr(verified, "STORE_PIECE", PIECE)


def payload_of(size: int, seed: int = 1) -> bytes:
    return bytes((seed * 131 + i * 7) % 251 for i in range(size))


def write_record(path: Path, payload: bytes, align: int = 512) -> int:
    header = encode_header(KEY, payload, align=align)
    path.write_bytes(header + payload)
    return len(header)


def decoder(key: ObjectKey = KEY):
    return lambda view: decode_header(view, expected_key=key)


def read(path: Path, header_len: int, length: int, **kwargs: object) -> tuple[bool, bytes]:
    buffer = bytearray(length)
    fd = os.open(path, os.O_RDONLY)
    try:
        ok = read_record_file(fd, memoryview(bytearray(header_len)), memoryview(buffer), decoder(), **kwargs)  # type: ignore[arg-type]
    finally:
        os.close(fd)
    return ok, bytes(buffer)


@pytest.mark.parametrize("size", [0, 1, PIECE - 1, PIECE, 3 * PIECE + 17])
def test_read_record_file_returns_the_verified_payload(tmp_path: Path, size: int) -> None:
    data = payload_of(size)
    header_len = write_record(tmp_path / "r.bin", data)
    assert read(tmp_path / "r.bin", header_len, size) == (True, data)


@pytest.mark.parametrize("first_piece", [1, 100, PIECE, 10 * PIECE])
def test_the_first_read_may_take_any_amount_of_payload(tmp_path: Path, first_piece: int) -> None:
    data = payload_of(3 * PIECE + 5)
    header_len = write_record(tmp_path / "r.bin", data)
    assert read(tmp_path / "r.bin", header_len, len(data), first_piece=first_piece) == (True, data)


@pytest.mark.parametrize("where", ["first", "middle", "last", "only"])
def test_damage_in_any_piece_is_a_checksum_error(tmp_path: Path, where: str) -> None:
    # "only": a payload of one piece, verified with the one-shot hash
    data = payload_of(PIECE if where == "only" else 4 * PIECE)
    offset = {"first": 3, "middle": 2 * PIECE + 9, "last": 4 * PIECE - 1, "only": PIECE // 2}[where]
    damaged = bytearray(data)
    damaged[offset] ^= 0x40
    header = encode_header(KEY, data, align=512)
    (tmp_path / "r.bin").write_bytes(header + bytes(damaged))
    with pytest.raises(RecordChecksumError):
        read(tmp_path / "r.bin", len(header), len(data))


def test_a_damaged_header_is_corrupt_before_the_payload_is_read(tmp_path: Path) -> None:
    data = payload_of(2 * PIECE)
    header_len = write_record(tmp_path / "r.bin", data)
    raw = bytearray((tmp_path / "r.bin").read_bytes())
    raw[40] ^= 1
    (tmp_path / "r.bin").write_bytes(bytes(raw))
    with pytest.raises(RecordCorruptError):
        read(tmp_path / "r.bin", header_len, len(data))


def test_a_record_of_other_lengths_is_corrupt(tmp_path: Path) -> None:
    data = payload_of(2 * PIECE)
    header_len = write_record(tmp_path / "r.bin", data + b"xx")
    with pytest.raises(RecordCorruptError, match="record header says"):
        read(tmp_path / "r.bin", header_len, len(data))


def test_a_file_that_ends_early_is_a_miss(tmp_path: Path) -> None:
    data = payload_of(3 * PIECE)
    header_len = write_record(tmp_path / "r.bin", data)
    with open(tmp_path / "r.bin", "r+b") as handle:
        handle.truncate(header_len + 2 * PIECE + 1)
    assert read(tmp_path / "r.bin", header_len, len(data))[0] is False
    with open(tmp_path / "r.bin", "r+b") as handle:
        handle.truncate(header_len - 1)
    assert read(tmp_path / "r.bin", header_len, len(data))[0] is False


def test_a_header_the_decoder_declines_is_a_miss_and_nothing_more_is_read(tmp_path: Path) -> None:
    data = payload_of(3 * PIECE)
    header_len = write_record(tmp_path / "r.bin", data)
    buffer = bytearray(len(data))
    fd = os.open(tmp_path / "r.bin", os.O_RDONLY)
    try:
        header = memoryview(bytearray(header_len))
        assert not read_record_file(fd, header, memoryview(buffer), lambda _v: None)
    finally:
        os.close(fd)
    assert buffer[PIECE:] == bytes(len(data) - PIECE)  # only the first piece was read


def test_short_reads_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = payload_of(3 * PIECE + 11)
    header_len = write_record(tmp_path / "r.bin", data)
    real = os.preadv

    def stingy(fd: int, buffers: list[memoryview], offset: int) -> int:
        # At most 1000 bytes per call, split across buffer boundaries.
        budget, views = 1000, []
        for buffer in buffers:
            if budget <= 0:
                break
            views.append(buffer[: min(budget, buffer.nbytes)])
            budget -= views[-1].nbytes
        return real(fd, views, offset)

    monkeypatch.setattr(verified.os, "preadv", stingy)
    assert read(tmp_path / "r.bin", header_len, len(data)) == (True, data)


def record_for(data: bytes, algo: int | None = None) -> RecordHeader:
    header = decode_header(encode_header(KEY, data), expected_key=KEY)
    if algo is None:
        return header
    return header._replace(checksum=checksum(data, algo), checksum_algo=algo)


@pytest.mark.parametrize("size", [0, 5, PIECE, 5 * PIECE + 3])
@pytest.mark.parametrize("algo", [None, CHECKSUM_BLAKE3_128])
def test_copy_verified_copies_and_accepts_an_intact_payload(size: int, algo: int | None) -> None:
    data = payload_of(size, seed=size)
    target = bytearray(size)
    copy_verified(memoryview(target), data, record_for(data, algo))
    assert bytes(target) == data


@pytest.mark.parametrize(
    ("size", "offset"),
    [(5 * PIECE + 3, 0), (5 * PIECE + 3, PIECE + 1), (5 * PIECE + 3, 5 * PIECE + 2), (PIECE, 7)],
)
def test_copy_verified_refuses_a_damaged_payload(size: int, offset: int) -> None:
    data = payload_of(size)
    damaged = bytearray(data)
    damaged[offset] ^= 0x80
    with pytest.raises(RecordChecksumError):
        copy_verified(memoryview(bytearray(len(data))), bytes(damaged), record_for(data))


def test_copies_refuse_other_lengths_and_read_only_targets() -> None:
    data = payload_of(2 * PIECE)
    for copy in (lambda t, s: copy_verified(t, s, record_for(data)), copy_and_checksum):
        with pytest.raises(ValueError):
            copy(memoryview(bytearray(len(data) - 1)), data)
        with pytest.raises(TypeError):
            copy(memoryview(bytes(len(data))), data)


@pytest.mark.parametrize("size", [0, 1, PIECE, 7 * PIECE + 1])
def test_copy_and_checksum_gives_the_record_checksum_of_the_copy(size: int) -> None:
    data = payload_of(size, seed=3)
    target = bytearray(size)
    digest = copy_and_checksum(memoryview(target), data)
    assert bytes(target) == data
    assert digest == checksum(data)
    # A header built from that digest is the header built from the payload.
    assert encode_header(KEY, data, digest=digest) == encode_header(KEY, data)


@pytest.mark.parametrize("piece", [PIECE // 2, 3 * PIECE, 64 * PIECE])
def test_copy_and_checksum_in_pieces_of_another_size_gives_the_same_checksum(piece: int) -> None:
    data = payload_of(7 * PIECE + 1, seed=4)
    target = bytearray(len(data))
    assert copy_and_checksum(memoryview(target), data, piece=piece) == checksum(data)
    assert bytes(target) == data


def test_encode_header_refuses_a_digest_of_another_length() -> None:
    with pytest.raises(ValueError, match="digest"):
        encode_header(KEY, b"abc", digest=b"short")
