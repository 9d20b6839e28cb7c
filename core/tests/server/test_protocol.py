"""Wire format: stable tags, round trips, limits enforced at decode time."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p

KEY = ObjectKey("model", 7, b"\x01" * 32, 2, "tenant")

REQUESTS = [
    p.Hello(1, "tok", p.PROTOCOL_VERSION, "engine", 42),
    p.Ping(2, ""),
    p.Lookup(3, "", [KEY]),
    p.QueryPrefetchStatus(4, "", 9),
    p.WaitPrefetchStatus(5, "", 9, 1.5),
    p.StoreReserve(6, "", [KEY], [4096]),
    p.StoreCommit(7, "", [KEY]),
    p.StoreCommit(7, "", [KEY], True),
    p.StoreAbort(8, "", [KEY]),
    p.StoreInline(9, "", [KEY]),
    p.StoreInline(9, "", [KEY], l1_only=True),
    p.StoreInline(9, "", [KEY], ["uint8[4096]"], True),
    p.Retrieve(10, "", [KEY], True),
    p.Release(11, "", [KEY]),
    p.Clear(12, "", True),
    p.Status(13, ""),
    p.Evict(14, "", [KEY]),
]

REPLIES = [
    p.ErrorReply(1, p.ErrorCode.NOT_FOUND, "nope"),
    p.HelloReply(1, shm_name="seg", shm_size=10, shm_device=1, shm_inode=2, chunk_size=256),
    p.PingReply(2),
    p.LookupReply(3, handle=5, hits=None),
    p.PrefetchStatusReply(4, hits=3),
    p.StoreReserveReply(6, slots=[p.Slot(4096, 100), p.Slot(p.NO_SLOT, 100)]),
    p.StoreReply(7, done=[True, False]),
    p.RetrieveReply(10, slots=[p.Slot(0, 1)], truncated=True),
    p.ReleaseReply(11, released=2),
    p.ClearReply(12, cleared=3),
    p.StatusReply(13, status={"l1": {"objects": 1}}),
    p.EvictReply(14, evicted=1),
    p.HelloReply(1, features=["l1_only_store", "evict"]),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_requests_round_trip(request_: p.Request) -> None:
    assert p.request_decoder.decode(p.encode(request_)) == request_


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_replies_round_trip(reply: p.Reply) -> None:
    assert p.reply_decoder.decode(p.encode(reply)) == reply


def test_op_numbers_are_stable() -> None:
    # Changing any of these breaks deployed clients: bump PROTOCOL_VERSION instead.
    assert [int(op) for op in p.Op] == list(range(15))
    assert msgspec.msgpack.decode(p.encode(p.Ping(77, "t"))) == [p.Op.PING, 77, "t"]
    assert msgspec.msgpack.decode(p.encode(p.ErrorReply(5, 4, "m"))) == [0, 5, 4, "m"]
    assert [int(code) for code in p.ErrorCode] == list(range(11))


def test_keys_are_validated_while_decoding() -> None:
    raw = msgspec.msgpack.encode([p.Op.LOOKUP, 1, "", [["a@b", 0, b"h", 0, ""]]])
    with pytest.raises(msgspec.ValidationError, match="model_name"):
        p.request_decoder.decode(raw)
    raw = msgspec.msgpack.encode([p.Op.LOOKUP, 1, "", [["m", 0, b"h", 0, "a/b"]]])
    with pytest.raises(msgspec.ValidationError, match="cache_salt"):
        p.request_decoder.decode(raw)


@pytest.mark.parametrize(
    "document",
    [
        [p.Op.STORE_RESERVE, 1, "", [], [0]],  # zero-byte object
        [p.Op.STORE_RESERVE, 1, "", [], [-5]],
        [p.Op.WAIT_PREFETCH_STATUS, 1, "", 3, 1e9],  # timeout beyond an hour
        [p.Op.PING, -1, ""],  # negative request id
        [p.Op.PING, 1, "x" * 300],  # token longer than any real one
        [p.Op.LOOKUP, 1, "", [["m", 0, b"h"]] * (p.MAX_KEYS_PER_REQUEST + 1)],
    ],
)
def test_out_of_range_fields_are_refused(document: list[object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        p.request_decoder.decode(msgspec.msgpack.encode(document))


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (b"\xc1", (0, p.ErrorCode.MALFORMED)),  # never valid msgpack
        (msgspec.msgpack.encode({"op": 2}), (0, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([42, 9, ""]), (9, p.ErrorCode.UNKNOWN_OP)),
        (msgspec.msgpack.encode([p.Op.PING, 9]), (9, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([p.Op.PING, True, ""]), (0, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([p.Op.PING, 2**64 - 1, ""]), (0, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([True, 3]), (3, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([[p.Op.PING], 3, ""]), (3, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([p.Op.PING, "x" * 40, ""]), (0, p.ErrorCode.MALFORMED)),
        # An op tag or request id that is a malformed timestamp (an ext of type -1 whose
        # length is not 4, 8 or 12): answered MALFORMED, never raised out of the diagnosis,
        # which runs on the loop thread serving every client.
        (bytes([0x93, 0xC7, 0x00, 0xFF, 0x03, 0xA0]), (3, p.ErrorCode.MALFORMED)),
        (bytes([0x93, 0x01, 0xD5, 0xFF, 0x00, 0x00, 0xA0]), (0, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([p.Op.LOOKUP, 4, "", [b"k"] * 20]), (4, p.ErrorCode.MALFORMED)),
        (msgspec.msgpack.encode([p.Op.LOOKUP, 5, "", [b"k"] * 9000]), (5, p.ErrorCode.TOO_LARGE)),
        (msgspec.msgpack.encode([p.Op.LOOKUP, 6, "", [b"k"] * 70000]), (6, p.ErrorCode.TOO_LARGE)),
        (msgspec.msgpack.encode([p.Op.LOOKUP, 7, "", [b"k"] * 8192, 1]), (7, p.ErrorCode.MALFORMED)),
    ],
)
def test_diagnosis_of_undecodable_headers(header: bytes, expected: tuple[int, p.ErrorCode]) -> None:
    assert p.diagnose_undecodable(header) == expected


def _diagnosed_in_little_memory(header: bytes) -> tuple[int, p.ErrorCode]:
    """The diagnosis of ``header``, checked to have built nothing per key or field."""
    tracemalloc.start()
    try:
        diagnosis = p.diagnose_undecodable(header)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10
    return diagnosis


def test_diagnosing_a_header_of_too_many_keys_builds_nothing_per_key() -> None:
    # Refused on the loop thread that serves every client: a client sending headers of
    # 140000 keys (4 MiB) must not make it build an object for each of them.
    keys = [ObjectKey("m", 0, index.to_bytes(16, "big")) for index in range(140_000)]
    header = msgspec.msgpack.encode([p.Op.LOOKUP, 8, "", keys])
    assert len(header) < p.MAX_HEADER_BYTES
    del keys
    assert _diagnosed_in_little_memory(header) == (8, p.ErrorCode.TOO_LARGE)


def test_diagnosing_a_header_of_many_fields_builds_nothing_per_field() -> None:
    # A header may be a top-level array of a million one-byte fields: only the fields that
    # can tell the id and a key count are looked at, the rest skipped unread.
    header = msgspec.msgpack.encode([p.Op.LOOKUP, 9, "", [b"k"] * 9000] + [0] * 1_000_000)
    assert len(header) < p.MAX_HEADER_BYTES
    assert _diagnosed_in_little_memory(header) == (9, p.ErrorCode.TOO_LARGE)


_VALID_HEADERS = [
    msgspec.msgpack.encode([p.Op.LOOKUP, 2**40, "model", [b"k" * 16] * 3, [1, 2], {"a": 1.5}]),
    msgspec.msgpack.encode([p.Op.PING, 7]),
    msgspec.msgpack.encode([99, 2**63 - 1, "", [b"k"] * 20, [], [None]]),
]


def _damaged(header: bytes, cut: int, changes: list[tuple[int, int]]) -> bytes:
    """``header`` cut short at ``cut`` (past its end: whole), then with bytes overwritten."""
    damaged = bytearray(header[: max(1, cut)])
    for position, value in changes:
        damaged[position % len(damaged)] = value
    return bytes(damaged)


_undecodable_headers = st.one_of(
    st.binary(max_size=64),
    # an array of two to six fields, each a few random bytes: op tags and request ids of every
    # msgpack type, short exts (malformed timestamps among them) included
    st.builds(
        lambda fields: bytes([0x90 + len(fields)]) + b"".join(fields),
        st.lists(st.binary(min_size=1, max_size=10), min_size=1, max_size=6),
    ),
    st.builds(
        _damaged,
        st.sampled_from(_VALID_HEADERS),
        st.integers(0, 200),
        st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
    ),
)


# Some 3000 headers in all, drawn a batch per example: hypothesis's own work per example
# costs far more than a diagnosis, and a failing batch still shrinks to the one header.
@settings(max_examples=400, deadline=None)
@given(st.lists(_undecodable_headers, min_size=4, max_size=12))
def test_diagnosing_any_bytes_never_raises(headers: list[bytes]) -> None:
    # The diagnosis runs on the loop thread serving every client, on bytes a peer chose.
    for header in headers:
        req_id, code = p.diagnose_undecodable(header)
        assert 0 <= req_id < 1 << 63, header
        assert code in (p.ErrorCode.MALFORMED, p.ErrorCode.UNKNOWN_OP, p.ErrorCode.TOO_LARGE), header


class _OldSlot(msgspec.Struct, array_like=True, gc=False):
    offset: int
    size: int


class _OldRetrieveReply(msgspec.Struct, array_like=True, gc=False, tag_field="op", tag=p.Op.RETRIEVE.value):
    req_id: int
    code: int = 0
    message: str = ""
    slots: list[_OldSlot] = []
    truncated: bool = False


def test_generations_are_optional_in_both_directions() -> None:
    # a client of the previous release ignores the trailing generation...
    new = p.RetrieveReply(4, slots=[p.Slot(8192, 10, 5)])
    old = msgspec.msgpack.decode(p.encode(new), type=_OldRetrieveReply)
    assert [(slot.offset, slot.size) for slot in old.slots] == [(8192, 10)]
    # ...and a reply of the previous release decodes with generation 0 and no table
    decoded = p.reply_decoder.decode(msgspec.msgpack.encode(_OldRetrieveReply(4, slots=[_OldSlot(0, 3)])))
    assert isinstance(decoded, p.RetrieveReply) and decoded.slots == [p.Slot(0, 3, 0)]
    hello = p.reply_decoder.decode(msgspec.msgpack.encode([p.Op.HELLO, 1, 0, "", 1, "", 256]))
    assert isinstance(hello, p.HelloReply) and (hello.generation_offset, hello.generation_block) == (0, 0)


@pytest.mark.parametrize("req_id", [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32, 2**63 - 1])
def test_the_request_id_of_an_oversized_header_is_read_from_its_start(req_id: int) -> None:
    header = p.encode(p.Lookup(req_id, "t" * 200, [KEY] * 100))
    assert p.peek_request_id(header) == req_id
    assert p.peek_request_id(header[:3]) == (req_id if req_id < 128 else 0)


@pytest.mark.parametrize(
    "header",
    [b"", b"\x92", msgspec.msgpack.encode({"op": 3}), msgspec.msgpack.encode([300, 7]), b"\x93\x03\xcf\x01"],
)
def test_headers_that_do_not_start_like_a_request_have_no_id(header: bytes) -> None:
    assert p.peek_request_id(header) == 0
