"""Random and mutated frames against a live server speaking LMCache's MP protocol: it keeps
serving (a ping is answered after every message), never dies, and gives everything back."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from fuzz_kit import connected_dealer, msgpack_values, mutate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lmcache_plugin_lmcache_mp.wire import OPERATION_IDS, SIGNATURES, CacheKey, RegisterPayload
from tiers_e2e import ServerProcess, start_server

REPLY_TIMEOUT_MS = 15_000
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_uids = itertools.count(1 << 40)
# Pings take ids of their own: a fuzzed request (mutated, or replayed from hypothesis's
# database in a later run) may carry any id, the next ping's included.
_ping_uids = itertools.count(1 << 50)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("fuzz-mp"),
        metrics=False,
        l1_size_gb=0.0625,
        frontends=[{"type": "lmcache_mp", "allow_pickle": True, "max_message_mb": 4}],
    )
    yield server
    assert server.proc.poll() is None, f"the server died during fuzzing\n{server.output()}"
    assert server.stop() == 0, server.output()
    assert not server.shm_path.exists()
    # Refusals are expected; an exception no handler anticipated is a bug.
    assert "ERROR lmcache_plugin_lmcache_mp" not in server.output(), server.output()


@pytest.fixture(scope="module")
def dealer(fuzz_server: ServerProcess) -> Iterator[zmq.Socket[bytes]]:
    with connected_dealer(fuzz_server.url) as sock:
        yield sock


def check_alive(sock: zmq.Socket[bytes], server: ServerProcess, frames: list[bytes]) -> None:
    """Send ``frames`` (answered or not, as LMCache's server would), then a ping that must be."""
    sock.send_multipart(frames)
    uid = msgspec.msgpack.encode(next(_ping_uids))
    sock.send_multipart([uid, msgspec.msgpack.encode(OPERATION_IDS["ping"]), msgspec.msgpack.encode(None)])
    while True:
        assert sock.poll(REPLY_TIMEOUT_MS), f"no answer to a ping after {[f[:40] for f in frames]}"
        reply = sock.recv_multipart()
        # Another reply under the same id can only answer the fuzzed request: keep waiting.
        if reply[0] == uid and len(reply) == 3 and reply[2] == msgspec.msgpack.encode(True):
            break
    assert server.proc.poll() is None


# -- strategies ----------------------------------------------------------------------------

small_ints = st.integers(-5, 300)
tokens = st.lists(st.integers(-1, 2**32), max_size=600)
cache_keys = st.fixed_dictionaries(
    {
        "model_name": st.sampled_from(["m", "meta-llama/x", "a@b", ""]),
        "world_size": st.integers(-1, 300),
        "worker_id": st.one_of(st.none(), st.integers(-1, 4)),
        "token_ids": tokens,
        "start": small_ints,
        "end": st.integers(-5, 700),
        "request_id": st.text(max_size=6),
        "cache_salt": st.sampled_from(["", "t", "a/b"]),
        "request_configs": st.none(),
        "num_kv_readers": st.integers(-1, 3),
    }
)
registrations = st.fixed_dictionaries(
    {
        "instance_id": st.integers(0, 3),
        "model_name": st.sampled_from(["m", "meta-llama/x"]),
        "world_size": st.integers(0, 3),
        "block_size": st.integers(-1, 32),
        "num_layers": st.integers(-1, 3),
        "hidden_dim_size": st.integers(-1, 128),
        "dtype_str": st.sampled_from(["bfloat16", "float16", "float42", ""]),
        "use_mla": st.booleans(),
        "num_physical_slots": st.one_of(st.none(), st.integers(-1, 256)),
    }
)
VALUES: dict[Any, Any] = {
    int: small_ints,
    str: st.text(max_size=6),
    bool: st.booleans(),
    bytes: st.binary(max_size=64),
    float: st.floats(0, 0.2),
}


def arguments_of(name: str) -> st.SearchStrategy[list[Any]]:
    parts = []
    for kind in SIGNATURES[name]:
        if kind is CacheKey:
            parts.append(cache_keys)
        elif kind is RegisterPayload:
            parts.append(registrations)
        else:
            parts.append(VALUES.get(kind, st.one_of(st.none(), small_ints)))
    return st.tuples(*parts).map(list)


valid_requests = st.sampled_from(sorted(SIGNATURES)).flatmap(
    lambda name: arguments_of(name).map(lambda args: [name, *args])
)


def encode_request(request: list[Any]) -> list[bytes]:
    name, *args = request
    uid = msgspec.msgpack.encode(next(_uids))
    return [
        uid,
        msgspec.msgpack.encode(OPERATION_IDS.get(name, name)),
        *(msgspec.msgpack.encode(a) for a in args),
    ]


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = [bytearray(frame) for frame in encode_request(draw(valid_requests))]
    for _ in range(draw(st.integers(1, 4))):
        mutate(draw, frames[draw(st.integers(0, len(frames) - 1))])
    return [bytes(frame) for frame in frames]


# -- tests ---------------------------------------------------------------------------------


@FUZZ
@given(frames=st.lists(st.binary(max_size=512), min_size=1, max_size=6))
def test_random_frames(dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, frames: list[bytes]) -> None:
    check_alive(dealer, fuzz_server, frames)


@FUZZ
@given(request=valid_requests)
def test_requests_with_any_field_values(
    dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, request: list[Any]
) -> None:
    check_alive(dealer, fuzz_server, encode_request(request))


@FUZZ
@given(frames=mutated())
def test_mutated_requests(dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, frames: list[bytes]) -> None:
    check_alive(dealer, fuzz_server, frames)


@FUZZ
@given(
    op=st.one_of(st.integers(-3, 40), st.sampled_from(sorted(OPERATION_IDS))),
    values=st.lists(msgpack_values, max_size=4),
)
def test_wrong_shapes(
    dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, op: Any, values: list[Any]
) -> None:
    check_alive(dealer, fuzz_server, encode_request([op, *values]))


def test_pathological_messages(dealer: zmq.Socket[bytes], fuzz_server: ServerProcess) -> None:
    uid = msgspec.msgpack.encode(1)
    nested = b"\x91" * 100_000 + b"\xc0"  # an array nested 100k deep
    for frames in (
        [uid, nested],
        [uid, msgspec.msgpack.encode(OPERATION_IDS["lookup"]), nested, msgspec.msgpack.encode(1)],
        [uid, b"", b"ack"],  # stream control, for a stream nobody opened
        [uid, msgspec.msgpack.encode(True)],
        [uid, msgspec.msgpack.encode(OPERATION_IDS["noop"]), *([b"\xc0"] * 40)],  # too many frames
        [uid],
        [b""],
    ):
        check_alive(dealer, fuzz_server, frames)


def test_a_peer_over_the_frame_limit_is_dropped_alone(fuzz_server: ServerProcess) -> None:
    with connected_dealer(fuzz_server.url) as rogue, connected_dealer(fuzz_server.url) as honest:
        rogue.send_multipart([msgspec.msgpack.encode(1), msgspec.msgpack.encode(17), bytes(8 << 20)])
        check_alive(honest, fuzz_server, [msgspec.msgpack.encode(2), msgspec.msgpack.encode(24)])


def test_everything_is_given_back_at_the_end(tmp_path: Path) -> None:
    """Fuzzed registrations, reservations and lookups hold L1; a stop releases all of it."""
    server = start_server(tmp_path / "server", l1_size_gb=0.0625, frontends=[{"type": "lmcache_mp"}])
    registration = {
        "instance_id": 1,
        "model_name": "m",
        "world_size": 1,
        "block_size": 16,
        "num_layers": 1,
        "hidden_dim_size": 8,
        "dtype_str": "float16",
        "use_mla": False,
        "num_physical_slots": 256,
    }
    key = {
        "model_name": "m",
        "world_size": 1,
        "worker_id": 0,
        "token_ids": list(range(1024)),
        "start": 0,
        "end": 1024,
        "request_id": "r",
        "num_kv_readers": 1,
    }
    with connected_dealer(server.url) as sock:
        for request in (["register_kv_cache_engine_driven_context", registration], ["prepare_store", key, 1]):
            check_alive(sock, server, encode_request(request))
    assert server.stop() == 0, server.output()
    assert "4 unfinished stores aborted" in server.output()
