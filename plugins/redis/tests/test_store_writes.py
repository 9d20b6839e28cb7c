"""A standalone store trip written on the thread's own connection (writes.py), against a
peer on a real socket that plays the store: the bytes on the wire, and the store's
answer to an object over its ``proto-max-bulk-len`` read as that object's reply."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from unittest import mock

import pytest
from lmcache_plugin_redis.backend import _dropped_indices
from lmcache_plugin_redis.direct import pack_command
from lmcache_plugin_redis.replies import ReplyReader
from lmcache_plugin_redis.writes import RecordHeaders, write_records
from redis.exceptions import ResponseError

from lmcache_tiers.plugin import ObjectKey
from lmcache_tiers.testing.l2 import make_keys


class _Context:
    """Record headers that name their payload's first byte (the real ones: core's), each
    header taken (``digest`` None) or checked (a digest given) noted in ``events``; a key
    in ``refused`` has a header that cannot be made."""

    def __init__(self, refused: tuple[ObjectKey, ...] = ()) -> None:
        self.events: list[str] = []
        self.refused = refused

    def record_header(self, key: ObjectKey, payload: memoryview, digest: bytes | None = None) -> bytes:
        if key in self.refused:
            raise ValueError("record header of 70000 bytes exceeds 65536")
        self.events.append(f"{'header' if digest is None else 'check'} {bytes(payload[:1])[0]}")
        return b"header-of-%d" % bytes(payload[:1])[0]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.settimeout(5.0)
    theirs.settimeout(5.0)
    yield ours, theirs
    ours.close()
    theirs.close()


def _received(sock: socket.socket, length: int) -> bytes:
    data = b""
    while len(data) < length:
        piece = sock.recv(length - len(data))
        assert piece, "the trip ended early"
        data += piece
    return data


def test_a_trip_is_the_sets_redis_py_would_send_and_the_bulk_limit_answer_drops_its_object(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    # Redis answers a string over proto-max-bulk-len with "ERR Protocol error: invalid
    # bulk length" just before it closes the connection.  redis-py strips the "ERR " from
    # such a text; the direct reader keeps it, and the object must still be read as
    # dropped (its limits read again, it refused alone), not as a reply error about it.
    ours, theirs = pair
    keys = make_keys(2)
    payloads = [memoryview(bytearray([7]) * 3000), memoryview(bytearray([9]) * 5000)]
    names = {0: b"prefix:zero", 1: b"prefix:one"}
    headers = RecordHeaders(_Context(), keys, payloads)  # type: ignore[arg-type]
    expected = b"".join(
        pack_command(b"SET", names[index], b"header-of-%d" % payloads[index][0] + bytes(payloads[index]))
        for index in (0, 1)
    )
    theirs.sendall(b"+OK\r\n-ERR Protocol error: invalid bulk length\r\n")
    reader = ReplyReader()
    reader.attach(ours)
    replies = write_records(ours.sendall, reader, names, payloads, headers, [0, 1], [])
    assert _received(theirs, len(expected)) == expected
    assert replies[0] == "OK"
    assert isinstance(replies[1], ResponseError)
    assert _dropped_indices([0, 1], replies) == [1]


def test_a_record_header_is_taken_after_the_payload_before_it_is_sent_and_checked_before_the_trip() -> None:
    # A header goes before its payload (``SET name <header><payload>``): each but the
    # trip's first is taken while the store reads the payload sent just before; whether
    # the header can be made at all is known before the trip's first byte.
    keys = make_keys(2)
    payloads = [memoryview(bytearray([7]) * 30), memoryview(bytearray([9]) * 50)]
    context = _Context()
    headers = RecordHeaders(context, keys, payloads)  # type: ignore[arg-type]

    def send(data: bytes | memoryview) -> None:
        if isinstance(data, memoryview):
            context.events.append(f"payload {bytes(data[:1])[0]}")

    reader = mock.Mock(spec=ReplyReader)
    reader.status_reply.return_value = "OK"
    assert write_records(send, reader, {0: b"a", 1: b"b"}, payloads, headers, [0, 1], []) == ["OK", "OK"]
    assert context.events == ["check 7", "check 9", "header 7", "payload 7", "header 9", "payload 9"]


def test_a_header_that_cannot_be_made_fails_its_trip_before_a_byte_is_sent(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    # Raised after the first record was sent, it would leave that record complete on the
    # wire: run by the store, and reported failed.
    ours, theirs = pair
    keys = make_keys(2)
    payloads = [memoryview(bytearray([7]) * 30), memoryview(bytearray([9]) * 50)]
    headers = RecordHeaders(_Context(refused=(keys[1],)), keys, payloads)  # type: ignore[arg-type]
    reader = ReplyReader()
    reader.attach(ours)
    with pytest.raises(ValueError, match="exceeds"):
        write_records(ours.sendall, reader, {0: b"a", 1: b"b"}, payloads, headers, [0, 1], [])
    theirs.setblocking(False)
    with pytest.raises(BlockingIOError):
        theirs.recv(1)
