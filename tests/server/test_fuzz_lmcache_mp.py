"""Random and mutated frames against a live server speaking LMCache's MP protocol: it keeps
serving (a ping is answered after every message), never dies, and gives everything back."""

from __future__ import annotations

import itertools
import math
import mmap
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


# Values at the edges of what msgpack carries, where the fields above stay small: ids and
# ranges past int64, reader counts in the billions, timeouts that never end or are no number.
extreme_ints = st.one_of(
    st.sampled_from([-(2**63), -1, 0, 2**31, 2**32, 2**63 - 1, 2**64 - 1]), st.integers(-(2**63), 2**64 - 1)
)
extreme_floats = st.one_of(
    st.floats(0, 0.2), st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -1.0, 5e-324])
)
extreme_keys = st.fixed_dictionaries(
    {
        "model_name": st.sampled_from(["m", "a@b", "", "x" * 300, "m\x00"]),
        "world_size": st.one_of(st.integers(0, 3), extreme_ints),
        "worker_id": st.one_of(st.none(), st.integers(-1, 4), extreme_ints),
        "token_ids": st.lists(st.one_of(st.integers(0, 9), extreme_ints), max_size=600),
        "start": st.one_of(st.sampled_from([0, 256, 512]), extreme_ints),
        "end": st.one_of(st.sampled_from([0, 256, 512]), extreme_ints),
        "request_id": st.text(max_size=200),
        "cache_salt": st.one_of(st.sampled_from(["", "a\x00", "/"]), st.text(max_size=200)),
        "num_kv_readers": st.one_of(st.integers(-1, 3), extreme_ints),
    },
    # LMCache's decoder ignores fields it does not know; request_configs may hold anything
    optional={"request_configs": msgpack_values, "unknown_field": msgpack_values},
)


def extreme_arguments_of(name: str) -> st.SearchStrategy[list[Any]]:
    return st.tuples(*(extreme_values_of(kind) for kind in SIGNATURES[name])).map(list)


def extreme_values_of(kind: Any) -> st.SearchStrategy[Any]:
    if kind is CacheKey:
        return extreme_keys
    if kind is RegisterPayload:
        return registrations
    if kind is int:
        return st.one_of(small_ints, extreme_ints)
    if kind is float:
        return extreme_floats
    return VALUES.get(kind, msgpack_values)


@FUZZ
@given(
    request=st.sampled_from(sorted(SIGNATURES)).flatmap(
        lambda name: extreme_arguments_of(name).map(lambda args: [name, *args])
    ),
    by_name=st.booleans(),
)
def test_requests_with_extreme_values(
    dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, request: list[Any], by_name: bool
) -> None:
    """Every field at its extremes; the operation sent by its id or, as LMCache's newer
    operations go on the wire, by its name."""
    frames = encode_request(request)
    if by_name:
        frames[1] = msgspec.msgpack.encode(request[0])
    check_alive(dealer, fuzz_server, frames)


# A session against a registered instance: prepares that reserve and read-lock real L1
# objects, commits (some of them pickled junk) and lookups in any order, so that fuzzing
# reaches the storage and not only the refusals of unknown instances.
SESSION_INSTANCE = 7
SESSION_LAYOUT = {
    "instance_id": SESSION_INSTANCE,
    "model_name": "session",
    "world_size": 1,
    "block_size": 16,
    "num_layers": 1,
    "hidden_dim_size": 8,
    "dtype_str": "float16",
    "use_mla": False,
    "num_physical_slots": None,
}
session_keys = st.fixed_dictionaries(
    {
        "model_name": st.just("session"),
        "world_size": st.just(1),
        "worker_id": st.sampled_from([0, 0, 0, None, 1]),
        "token_ids": st.sampled_from([0, 1, 2]).flatmap(
            lambda sequence: st.integers(0, 3).map(lambda chunks: [sequence] * (256 * chunks + 3))
        ),
        "start": st.sampled_from([0, 0, 256, 100]),
        "end": st.sampled_from([0, 256, 512, 768, 769]),
        "request_id": st.sampled_from(["a", "b", "c"]),
        "cache_salt": st.just(""),
        "request_configs": st.none(),
        "num_kv_readers": st.sampled_from([1, 1, 2, 0]),
    }
)
session_steps = st.one_of(
    st.tuples(st.sampled_from(["prepare_store", "prepare_retrieve", "commit_retrieve"]), session_keys).map(
        lambda step: [step[0], step[1], SESSION_INSTANCE]
    ),
    st.tuples(session_keys, st.sampled_from([b"", b"", b"\x80\x04junk", b"x"])).map(
        lambda step: ["commit_store", step[0], SESSION_INSTANCE, step[1]]
    ),
    st.tuples(st.sampled_from(["lookup", "free_lookup_locks"]), session_keys).map(
        lambda step: [step[0], step[1], 1]
    ),
    st.sampled_from(["a", "b", "c"]).map(lambda request_id: ["query_prefetch_status", request_id]),
    st.sampled_from(["a", "b", "c"]).map(lambda request_id: ["wait_prefetch_status", request_id, 0.05]),
    st.sampled_from(["a", "b", "c"]).map(lambda request_id: ["end_session", request_id]),
    st.just(["register_kv_cache_engine_driven_context", SESSION_LAYOUT]),
    st.just(["unregister_kv_cache_engine_driven_context", SESSION_INSTANCE]),
    st.sampled_from([True, False]).map(lambda force: ["clear", force]),
)


@FUZZ
@given(steps=st.lists(session_steps, min_size=1, max_size=12))
def test_sessions_of_a_registered_instance(
    dealer: zmq.Socket[bytes], fuzz_server: ServerProcess, steps: list[list[Any]]
) -> None:
    check_alive(
        dealer, fuzz_server, encode_request(["register_kv_cache_engine_driven_context", SESSION_LAYOUT])
    )
    for step in steps:
        check_alive(dealer, fuzz_server, encode_request(step))


def call(sock: zmq.Socket[bytes], request: list[Any]) -> Any:
    """``request``'s reply (None for void), skipping late replies to fuzzed requests."""
    frames = encode_request(request)
    sock.send_multipart(frames)
    while True:
        assert sock.poll(REPLY_TIMEOUT_MS), f"no answer to {request[0]}"
        reply = sock.recv_multipart()
        if reply[0] == frames[0]:
            return msgspec.msgpack.decode(reply[2]) if len(reply) > 2 else None


def test_after_fuzzing_a_store_reads_back_its_own_bytes(
    dealer: zmq.Socket[bytes], fuzz_server: ServerProcess
) -> None:
    """Whatever the fuzzed sessions left reserved, locked or half-committed, a clean store
    of new chunks is found by a lookup and read back byte for byte."""
    layout = {**SESSION_LAYOUT, "instance_id": 8, "model_name": "after-fuzz"}
    reply = call(dealer, ["register_kv_cache_engine_driven_context", layout])
    assert reply["shm_name"] and reply["pool_size"] > 0
    key = {
        "model_name": "after-fuzz",
        "world_size": 1,
        "worker_id": 0,
        "token_ids": [5] * 512,
        "start": 0,
        "end": 512,
        "request_id": "after",
        "num_kv_readers": 1,
    }
    payloads = [bytes([index + 1]) * 8192 for index in range(2)]  # one chunk: 2 x 1 x 256 x 8 float16
    with fuzz_server.shm_path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as segment:
        prepared = call(dealer, ["prepare_store", key, 8])["context"]
        assert prepared["chunk_indices"] == [0, 1]
        for slot, payload in zip(prepared["slots"], payloads, strict=True):
            segment[slot["offset"] : slot["offset"] + slot["length"]] = payload
        assert call(dealer, ["commit_store", key, 8, b""]) is True
        call(dealer, ["lookup", {**key, "worker_id": None}, 1])
        assert call(dealer, ["wait_prefetch_status", "after", 5.0]) == 2
        retrieved = call(dealer, ["prepare_retrieve", key, 8])
        assert retrieved["success"] is True
        slots = retrieved["context"]["slots"]
        assert [bytes(segment[s["offset"] : s["offset"] + s["length"]]) for s in slots] == payloads
        assert call(dealer, ["commit_retrieve", key, 8]) is True
    call(dealer, ["end_session", "after"])
    call(dealer, ["unregister_kv_cache_engine_driven_context", 8])


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
