"""The reply reader on real sockets: replies arriving whole or a byte at a time, replies
that are not what a lookup or load asks for, and a peer that hangs up or goes silent."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import xxhash
from lmcache_plugin_redis.backend import lookup_commands
from lmcache_plugin_redis.direct import pack_command
from lmcache_plugin_redis.records import HEAD_READ
from lmcache_plugin_redis.replies import MAX_LINE, SCRATCH_SIZE, ReplyReader
from redis.exceptions import BusyLoadingError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

PAYLOAD = bytes(range(256)) * ((3 * SCRATCH_SIZE) // 256 + 7)  # spans several scratch fills


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.settimeout(5.0)
    yield ours, theirs
    ours.close()
    theirs.close()


@pytest.fixture
def peer(pair: tuple[socket.socket, socket.socket]) -> tuple[ReplyReader, socket.socket]:
    """A reader of our end of the pair, and the other end, which plays the store."""
    reader = ReplyReader()
    reader.attach(pair[0])
    return reader, pair[1]


def feed(sock: socket.socket, data: bytes, *, piece: int) -> threading.Thread:
    """Write ``data`` in pieces of ``piece`` bytes from another thread."""

    def write() -> None:
        for start in range(0, len(data), piece):
            sock.sendall(data[start : start + piece])

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


LOAD_REPLIES = (
    bulk(b"header" + PAYLOAD)  # an object: its header, then its payload
    + b"$-1\r\n"  # an absent key
    + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    + bulk(b"other" + b"skipped payload")
    + bulk(b"")  # an empty value
    + b"+OK\r\n"  # a store's SET
    + bulk(b"a lookup's header")
    + b"$-1\r\n"
)


@pytest.mark.parametrize("piece", [5, 1000, 65537, len(LOAD_REPLIES)])
def test_replies_are_read_in_order_however_they_arrive(
    peer: tuple[ReplyReader, socket.socket], piece: int
) -> None:
    reader, theirs = peer
    writer = feed(theirs, LOAD_REPLIES, piece=piece)
    assert reader.bulk_start() == len(b"header") + len(PAYLOAD)
    assert reader.part(len(b"header")) == b"header"
    target = memoryview(bytearray(len(PAYLOAD)))
    pieces: list[int] = []
    hasher = xxhash.xxh3_128()

    def update(view: memoryview) -> None:
        pieces.append(view.nbytes)
        hasher.update(view)

    reader.part_into(target, update)
    reader.end_bulk()
    assert bytes(target) == PAYLOAD
    assert sum(pieces) == len(PAYLOAD), "every byte was hashed once, in order"
    assert hasher.digest() == xxhash.xxh3_128(PAYLOAD).digest()
    assert reader.bulk_start() == -1
    error = reader.bulk_start()
    assert isinstance(error, ResponseError) and str(error).startswith("WRONGTYPE")
    assert reader.bulk_start() == len(b"otherskipped payload")
    assert reader.part(5) == b"other"
    reader.skip_part(len(b"skipped payload"))
    reader.end_bulk()
    assert reader.bulk_start() == 0
    reader.end_bulk()
    assert reader.status_reply() == "OK"
    assert reader.bulk_reply() == b"a lookup's header"
    assert reader.bulk_reply() is None
    writer.join()


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (b"+OK\r\n", "expected a bulk string reply"),
        (b"*2\r\n", "expected a bulk string reply"),
        (b"$x\r\n", "bad length"),
        (b"$-5\r\n", "bad length"),
        (b"$3\r\nabcXY", "does not end with CRLF"),
        (b"$" + b"9" * (MAX_LINE + 10), "longer than"),
    ],
)
def test_replies_a_load_never_asks_for_are_protocol_errors(
    peer: tuple[ReplyReader, socket.socket], stream: bytes, message: str
) -> None:
    reader, theirs = peer
    feed(theirs, stream, piece=4096)
    with pytest.raises(InvalidResponse, match=message):
        assert reader.bulk_start() == 3
        reader.part(3)
        reader.end_bulk()


def test_a_refused_store_is_its_error_reply(peer: tuple[ReplyReader, socket.socket]) -> None:
    reader, theirs = peer
    theirs.sendall(b"-OOM command not allowed when used memory > 'maxmemory'.\r\n+OK\r\n")
    error = reader.status_reply()
    assert isinstance(error, ResponseError) and str(error).startswith("OOM")
    assert reader.status_reply() == "OK"


def test_a_lookups_payload_lengths_are_read_as_integers(peer: tuple[ReplyReader, socket.socket]) -> None:
    reader, theirs = peer
    feed(theirs, b":1048576\r\n:0\r\n-NOPERM User may not run strlen\r\n" + bulk(b"next"), piece=3)
    assert reader.integer_reply() == 1 << 20
    assert reader.integer_reply() == 0
    error = reader.integer_reply()
    assert isinstance(error, ResponseError) and str(error).startswith("NOPERM")
    assert reader.bulk_reply() == b"next"


@pytest.mark.parametrize(
    ("read", "stream", "message"),
    [
        # a store's reply that is no status
        ("status_reply", b":1\r\n", "expected a status reply"),
        ("status_reply", b"$2\r\nOK\r\n", "expected a status reply"),
        # a lookup's reply of another type
        ("bulk_reply", b"*1\r\n", "expected a bulk string reply"),
        # a lookup's length reply that is no integer
        ("integer_reply", b"$1\r\nx\r\n", "expected an integer reply"),
        ("integer_reply", b":12a\r\n", "bad integer"),
    ],
)
def test_a_reply_of_another_kind_than_expected_is_a_protocol_error(
    peer: tuple[ReplyReader, socket.socket], read: str, stream: bytes, message: str
) -> None:
    reader, theirs = peer
    theirs.sendall(stream)
    with pytest.raises(InvalidResponse, match=message):
        getattr(reader, read)()


def test_a_peer_hanging_up_inside_a_reply_is_a_connection_error(
    peer: tuple[ReplyReader, socket.socket],
) -> None:
    reader, theirs = peer
    theirs.sendall(b"$6\r\nhea")
    theirs.close()
    assert reader.bulk_start() == 6
    with pytest.raises(RedisConnectionError, match="closed"):
        reader.part(6)


def test_a_silent_peer_is_a_timeout(
    pair: tuple[socket.socket, socket.socket], peer: tuple[ReplyReader, socket.socket]
) -> None:
    pair[0].settimeout(0.1)
    reader, theirs = peer
    theirs.sendall(b"$6\r\n")
    started = time.monotonic()
    assert reader.bulk_start() == 6
    with pytest.raises(RedisTimeoutError):
        reader.part(6)
    assert time.monotonic() - started < 5.0


def test_a_detached_reader_fails_as_a_closed_connection() -> None:
    reader = ReplyReader()
    with pytest.raises(RedisConnectionError):
        reader.bulk_reply()


def test_commands_are_packed_as_arrays_of_bulk_strings() -> None:
    assert pack_command(b"GET", b"name") == b"*2\r\n$3\r\nGET\r\n$4\r\nname\r\n"
    assert pack_command(b"X", b"") == b"*2\r\n$1\r\nX\r\n$0\r\n\r\n"


@pytest.mark.parametrize("name", [b"", b"p:k", b"\xff" * 300])
def test_a_lookups_commands_are_packed_as_pack_command_packs_them(name: bytes) -> None:
    head = pack_command(b"GETRANGE", name, b"0", str(HEAD_READ - 1).encode())
    assert lookup_commands(name) == head + pack_command(b"STRLEN", name)


def test_a_store_still_loading_its_data_fails_the_call_not_one_object(
    peer: tuple[ReplyReader, socket.socket],
) -> None:
    reader, theirs = peer
    theirs.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")
    with pytest.raises(BusyLoadingError):
        reader.bulk_start()
