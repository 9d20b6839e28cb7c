"""A small client of LMCache's MP protocol for the tests, written from the protocol notes.

It sends what LMCache's client sends (one DEALER, ``[uid, op, arg...]`` frames with
msgpack maps for keys and payloads) and maps the L1 segment the way LMCache's SHM
transfer context does, so the front end is exercised without LMCache installed.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
from lmcache_plugin_lmcache_mp.wire import OPERATION_IDS

MODEL = "test-model"
HELLO_TOKEN = 9906
CHUNK_TOKENS = 256  # the server's chunk size in these tests
_NO_REPLY = object()
#: how often LMCache's client polls query_prefetch_status for a lookup's result
PREFETCH_POLL_S = 0.05
#: how long a lookup's prefetch may take before a test fails (L2 loads on a busy machine)
LOOKUP_TIMEOUT_S = 30.0
#: how long a stalled copy waits for the test at most (the tests never rely on it)
STALL_LIMIT_S = 60.0


def mp_address(server: Any) -> str:
    """The address of a TiersServer's LMCache front end."""
    return str(next(f.address for f in server.frontends if f.name.endswith(":lmcache_mp")))


def tokens_of(sequence: int, count: int = 1024) -> list[int]:
    """``(seq, 9906, 9906, ...)``: the token ids ``lmcache bench server`` sends."""
    return [sequence] + [HELLO_TOKEN] * count


@dataclass
class Key:
    """IPCCacheServerKey as LMCache's client encodes it (a map, every field)."""

    token_ids: list[int]
    request_id: str
    start: int = 0
    end: int = 0
    worker_id: int | None = None
    world_size: int = 1
    model_name: str = MODEL
    cache_salt: str = ""
    num_kv_readers: int = 1
    request_configs: dict[str, Any] | None = None

    def encode(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "token_ids": self.token_ids,
            "start": self.start,
            # LMCache's clients send chunk-aligned ranges: the bench ends a request's
            # range at its last full chunk (``num_full_tokens``)
            "end": self.end or len(self.token_ids) // CHUNK_TOKENS * CHUNK_TOKENS,
            "request_id": self.request_id,
            "cache_salt": self.cache_salt,
            "request_configs": self.request_configs,
            "num_kv_readers": self.num_kv_readers,
        }


def one_chunk(sequence: int, request_id: str) -> Key:
    """The key of the first chunk of request ``sequence``, on worker 0."""
    return Key(tokens_of(sequence), request_id, worker_id=0, end=CHUNK_TOKENS)


@dataclass
class Registration:
    instance_id: int = 1000
    model_name: str = MODEL
    world_size: int = 1
    block_size: int = 16
    num_layers: int = 2
    hidden_dim_size: int = 64
    dtype_str: str = "bfloat16"
    use_mla: bool = False
    num_physical_slots: int | None = 256

    def encode(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def object_bytes(self) -> int:
        planes = 1 if self.use_mla else 2
        slots = self.num_physical_slots or 256
        return planes * self.num_layers * slots * self.hidden_dim_size * 2


@dataclass
class MPClient:
    url: str
    timeout_ms: int = 10_000
    _uids: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.url)
        self._segment: mmap.mmap | None = None

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
        self.socket.close(0)
        self.context.term()

    def __enter__(self) -> MPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- raw calls ---------------------------------------------------------------------------

    def send(self, op: str | int, *args: Any) -> bytes:
        uid = msgspec.msgpack.encode(next(self._uids))
        wire_op = OPERATION_IDS.get(op, op) if isinstance(op, str) else op
        frames = [uid, msgspec.msgpack.encode(wire_op), *(msgspec.msgpack.encode(arg) for arg in args)]
        self.socket.send_multipart(frames)
        return uid

    def receive(self, uid: bytes, timeout_ms: int | None = None) -> Any:
        """The reply to ``uid`` (None for void), or _NO_REPLY when none comes in time."""
        wait = self.timeout_ms if timeout_ms is None else timeout_ms
        while self.socket.poll(wait):
            frames = self.socket.recv_multipart()
            if frames[0] != uid:
                continue  # a late reply to an earlier request
            return msgspec.msgpack.decode(frames[2]) if len(frames) > 2 else None
        return _NO_REPLY

    def call(self, op: str | int, *args: Any, timeout_ms: int | None = None) -> Any:
        reply = self.receive(self.send(op, *args), timeout_ms)
        if reply is _NO_REPLY:
            raise TimeoutError(f"no reply to {op}")
        return reply

    def unanswered(self, op: str | int, *args: Any, wait_ms: int = 300) -> bool:
        """True when ``op`` gets no reply within ``wait_ms`` (what LMCache's server does on errors)."""
        return self.no_reply_to(self.send(op, *args), wait_ms)

    def no_reply_to(self, uid: bytes, wait_ms: int = 300) -> bool:
        """True when the request sent as ``uid`` gets no reply within ``wait_ms``."""
        return self.receive(uid, wait_ms) is _NO_REPLY

    # -- the calls LMCache's bench makes -----------------------------------------------------

    def register(self, registration: Registration) -> dict[str, Any]:
        reply: dict[str, Any] = self.call("register_kv_cache_engine_driven_context", registration.encode())
        return reply

    def lookup(self, key: Key, timeout_s: float = LOOKUP_TIMEOUT_S) -> int | None:
        """lookup, then query_prefetch_status every 50 ms until it answers, as LMCache's
        client polls.  The lookup's own wait (lookup_wait_ms) usually settles it, but a
        prefetch from L2 on a busy machine may outlast it; the first query then answers
        None (still running), which is not the hit count."""
        self.call("lookup", key.encode(), 1)
        deadline = time.monotonic() + timeout_s
        while True:
            hits: int | None = self.call("query_prefetch_status", key.request_id)
            if hits is not None:
                return hits
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the lookup of {key.request_id} had no result after {timeout_s}s")
            time.sleep(PREFETCH_POLL_S)

    def segment(self, name: str) -> mmap.mmap:
        if self._segment is None:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self._segment = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
        return self._segment

    def store(self, key: Key, instance_id: int, chunks: list[bytes], shm_name: str) -> bool:
        """prepare_store, copy each reserved chunk into its slot, commit_store."""
        prepared = self.call("prepare_store", key.encode(), instance_id)
        context = prepared["context"]
        if "slots" not in context:
            return bool(self.call("commit_store", key.encode(), instance_id, b""))
        if not context["slots"]:
            return True  # everything present: LMCache's client skips the commit
        segment = self.segment(shm_name)
        for slot, index in zip(context["slots"], context["chunk_indices"], strict=True):
            assert slot["length"] == len(chunks[index])
            segment[slot["offset"] : slot["offset"] + slot["length"]] = chunks[index]
        return bool(self.call("commit_store", key.encode(), instance_id, b""))

    def retrieve(self, key: Key, instance_id: int, shm_name: str) -> list[bytes] | None:
        """prepare_retrieve, copy each chunk out of its slot, commit_retrieve."""
        prepared = self.call("prepare_retrieve", key.encode(), instance_id)
        chunks = None
        if prepared["success"]:
            segment = self.segment(shm_name)
            chunks = [
                bytes(segment[s["offset"] : s["offset"] + s["length"]]) for s in prepared["context"]["slots"]
            ]
        assert self.call("commit_retrieve", key.encode(), instance_id) is True
        return chunks


def wait_for(condition: Any, what: str, timeout_s: float = 20.0) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def pickled_chunks(payloads: list[bytes], registration: Registration | None = None) -> bytes:
    """Chunks as LMCache's client pickles them: a list of tensors of the registered layout
    (bfloat16; torch is imported here, only by the tests of the pickle path)."""
    import pickle

    import torch

    reg = registration or Registration()
    shape = (2, reg.num_layers, reg.num_physical_slots or CHUNK_TOKENS, reg.hidden_dim_size)
    return pickle.dumps([torch.frombuffer(bytearray(p), dtype=torch.bfloat16).view(shape) for p in payloads])


def chunk_payloads(sequence: int, count: int, size: int) -> list[bytes]:
    """Deterministic, distinct bytes for chunk ``i`` of request ``sequence``."""
    return [
        bytes([(sequence * 31 + index * 7 + offset) % 251 for offset in range(251)]) * (size // 251)
        + bytes(size % 251)
        for index in range(count)
    ]


@contextlib.contextmanager
def stalled_fills(storage: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Inside: every copy into ``storage``'s L1 (a pickled store's) waits until the event
    yielded is set -- a store slower than the drain -- which leaving the block does at the
    latest (the copies never wait longer than ``STALL_LIMIT_S``)."""
    lend = storage.lend
    go_on = threading.Event()

    def stalled(obj: Any, *, fill: bool = False) -> Any:
        if fill:
            go_on.wait(STALL_LIMIT_S)
        return lend(obj, fill=fill)

    monkeypatch.setattr(storage, "lend", stalled)
    try:
        yield go_on
    finally:
        go_on.set()


def send_pickled_store(
    client: MPClient, sequence: int, name: str, chunks: int = 4, tokens: int = 1024
) -> bytes:
    """Send a pickled commit_store of ``chunks`` chunks of request ``sequence`` (its key
    ``tokens`` tokens long, named ``name``), of the default registration, not waiting for
    its reply; the request's id."""
    registration = Registration()
    key = Key(tokens_of(sequence, tokens), name, worker_id=0)
    pickled = pickled_chunks(chunk_payloads(sequence, chunks, registration.object_bytes))
    return client.send("commit_store", key.encode(), registration.instance_id, pickled)


def send_stalled_store(client: MPClient, storage: Any, sequence: int, name: str) -> None:
    """Send a pickled commit_store of four chunks (not waiting for its reply), inside
    :func:`stalled_fills`, and return once its copy has its four reservations: it holds
    the pool's one thread from then on."""
    send_pickled_store(client, sequence, name)
    wait_for(lambda: storage.status()["l1"]["write_locked"] == 4, f"the store {name} never began its copy")
