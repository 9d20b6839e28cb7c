"""Random and mutated frames against a live server: every message is answered with a
well-formed reply, and the server keeps serving (PING) and stays up throughout."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from fuzz_kit import connected_dealer, msgpack_values, mutate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers_e2e import ServerProcess, start_server

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p

REPLY_TIMEOUT_MS = 15_000
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("fuzz"), metrics=False, l1_size_gb=0.0625)
    yield server
    assert server.proc.poll() is None, f"the server died during fuzzing\n{server.output()}"
    assert server.stop() == 0, server.output()
    assert not server.shm_path.exists()


@pytest.fixture(scope="module")
def dealer(fuzz_server: ServerProcess) -> Iterator[zmq.Socket[bytes]]:
    with connected_dealer(fuzz_server.url) as sock:
        yield sock


def exchange(sock: zmq.Socket[bytes], frames: list[bytes]) -> list[bytes]:
    sock.send_multipart(frames)
    assert sock.poll(REPLY_TIMEOUT_MS), f"no reply to {[f[:40] for f in frames]}"
    return sock.recv_multipart()


def check_answered_and_alive(sock: zmq.Socket[bytes], server: ServerProcess, frames: list[bytes]) -> None:
    reply_frames = exchange(sock, frames)
    reply = p.reply_decoder.decode(reply_frames[0])  # well-formed, whatever it says
    if reply.code != p.ErrorCode.OK:
        assert isinstance(reply, p.ErrorReply)
        assert reply.message
    ping = p.encode(p.Ping(4242, ""))
    answer = p.reply_decoder.decode(exchange(sock, [ping])[0])
    assert isinstance(answer, p.PingReply) and answer.req_id == 4242
    assert server.proc.poll() is None


# -- strategies ----------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_characters="/\\@\x00"), min_size=1, max_size=12).filter(
    lambda name: name not in (".", "..")
)
keys = st.builds(
    ObjectKey,
    names,
    st.integers(0, 2**32 - 1),
    st.binary(min_size=1, max_size=64),
    st.integers(0, 65535),
    st.just(""),
)
key_lists = st.lists(keys, max_size=6)
sizes = st.lists(st.integers(1, 1 << 20), max_size=6)

valid_requests = st.one_of(
    st.builds(p.Hello, st.integers(0, 99), st.just(""), st.integers(0, 3)),
    st.builds(p.Ping, st.integers(0, 99), st.just("")),
    st.builds(p.Lookup, st.integers(0, 99), st.just(""), key_lists),
    st.builds(p.QueryPrefetchStatus, st.integers(0, 99), st.just(""), st.integers(0, 2**40)),
    st.builds(p.WaitPrefetchStatus, st.integers(0, 99), st.just(""), st.integers(0, 5), st.floats(0, 0.5)),
    st.builds(p.StoreReserve, st.integers(0, 99), st.just(""), key_lists, sizes),
    st.builds(p.StoreCommit, st.integers(0, 99), st.just(""), key_lists),
    st.builds(p.StoreAbort, st.integers(0, 99), st.just(""), key_lists),
    st.builds(p.StoreInline, st.integers(0, 99), st.just(""), key_lists),
    st.builds(p.Retrieve, st.integers(0, 99), st.just(""), key_lists, st.booleans()),
    st.builds(p.Release, st.integers(0, 99), st.just(""), key_lists),
    st.builds(p.Clear, st.integers(0, 99), st.just(""), st.booleans()),
    st.builds(p.Status, st.integers(0, 99), st.just("")),
)


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    header = bytearray(p.encode(draw(valid_requests)))
    for _ in range(draw(st.integers(1, 4))):
        mutate(draw, header)
    payloads = draw(st.lists(st.binary(max_size=64), max_size=3))
    return [bytes(header), *payloads]


# -- tests ---------------------------------------------------------------------------------


@FUZZ
@given(frames=st.lists(st.binary(max_size=512), min_size=1, max_size=4))
def test_random_frames(dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, frames: list[bytes]) -> None:
    check_answered_and_alive(dealer, fuzz_server, frames)


@FUZZ
@given(frames=mutated())
def test_mutated_requests(dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, frames: list[bytes]) -> None:
    check_answered_and_alive(dealer, fuzz_server, frames)


@FUZZ
@given(value=msgpack_values, op=st.one_of(st.none(), st.integers(-3, 20)))
def test_wrong_shapes(
    dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, value: Any, op: int | None
) -> None:
    document = value if op is None else [op, 7, "", value]
    check_answered_and_alive(dealer, fuzz_server, [msgspec.msgpack.encode(document)])


@FUZZ
@given(request=valid_requests, payloads=st.lists(st.binary(min_size=1, max_size=256), max_size=3))
def test_valid_requests_with_any_payloads(
    dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, request: Any, payloads: list[bytes]
) -> None:
    check_answered_and_alive(dealer, fuzz_server, [p.encode(request), *payloads])


def test_oversized_and_pathological_messages(dealer: zmq.Socket[bytes], fuzz_server: ServerProcess) -> None:
    big_header = os.urandom(p.MAX_HEADER_BYTES + 1)
    reply = p.reply_decoder.decode(exchange(dealer, [big_header])[0])
    assert reply.code == p.ErrorCode.TOO_LARGE

    too_many_frames = [p.encode(p.StoreInline(5, "", []))] + [b"x"] * (p.MAX_KEYS_PER_REQUEST + 1)
    reply = p.reply_decoder.decode(exchange(dealer, too_many_frames)[0])
    assert (reply.code, reply.req_id) == (p.ErrorCode.TOO_LARGE, 5)

    nested = b"\x91" * 100_000 + b"\xc0"  # an array nested 100k deep
    reply = p.reply_decoder.decode(exchange(dealer, [nested])[0])
    assert reply.code == p.ErrorCode.MALFORMED

    unknown = msgspec.msgpack.encode([99, 31, ""])
    reply = p.reply_decoder.decode(exchange(dealer, [unknown])[0])
    assert (reply.code, reply.req_id) == (p.ErrorCode.UNKNOWN_OP, 31)

    empty = p.reply_decoder.decode(exchange(dealer, [b""])[0])
    assert empty.code == p.ErrorCode.MALFORMED
    check_answered_and_alive(dealer, fuzz_server, [p.encode(p.Status(1, ""))])


def test_server_survives_a_peer_over_the_frame_limit(tmp_path: Path) -> None:
    """A frame above ZMQ_MAXMSGSIZE disconnects that peer only; others keep being served."""
    server = start_server(tmp_path / "server", metrics=False, l1_size_gb=0.0625)
    context = zmq.Context()
    try:
        rogue = context.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(server.url)
        rogue.send_multipart([p.encode(p.StoreInline(1, "", [])), bytes(300 << 20)])
        honest = context.socket(zmq.DEALER)
        honest.setsockopt(zmq.LINGER, 0)
        honest.connect(server.url)
        check_answered_and_alive(honest, server, [p.encode(p.Ping(1, ""))])
        rogue.close(0)
        honest.close(0)
    finally:
        context.term()
        assert server.stop() == 0, server.output()
