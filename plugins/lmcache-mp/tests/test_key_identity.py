"""A chunk is only ever handed to a worker whose layout, model, rank and salt it was stored
for: every other reader gets a miss, counted, never the other bytes -- whether the chunk
is in L1 or comes back from an L2 another server wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

from lmcache_tiers.client import Client
from lmcache_tiers.keys import prefix_keys
from lmcache_tiers.plugin import kv_rank_of

BF16 = Registration(instance_id=1000, dtype_str="bfloat16")
#: the same shape as BF16, so the same number of bytes: only the layout tells them apart
FP16 = Registration(instance_id=1001, dtype_str="float16")
#: one plane of twice the hidden size: again the same number of bytes as BF16
MLA = Registration(instance_id=1002, use_mla=True, hidden_dim_size=2 * BF16.hidden_dim_size)
CHUNKS = 4


def _fs(root: Path) -> list[str]:
    return [json.dumps({"type": "fs", "path": str(root)})]


def _written_to_l2_and_cleared_from_l1(server: Any) -> None:
    """Leave the chunks in L2 only: what a reader finds there comes back with what its
    record states, not with anything L1 remembered from the store."""
    assert server.storage.flush(timeout=30)
    with MPClient(mp_address(server)) as admin:
        assert admin.call("clear", True) is None
    assert server.storage.status()["l1"]["objects"] == 0


def _failures(server: Any) -> Any:
    return next(f for f in server.frontends if f.name.endswith(":lmcache_mp")).stats().failures


def _store(server: Any, registration: Registration, key: Key, payloads: list[bytes]) -> None:
    with MPClient(mp_address(server)) as writer:
        shm = writer.register(registration)["shm_name"]
        assert writer.store(key, registration.instance_id, payloads, shm)


def _read(server: Any, registration: Registration, key: Key) -> tuple[int | None, list[bytes] | None]:
    """(lookup hits, what a retrieve of the looked-up chunks handed out)."""
    with MPClient(mp_address(server)) as reader:
        shm = reader.register(registration)["shm_name"]
        hits = reader.lookup(
            Key(
                key.token_ids,
                key.request_id,
                model_name=key.model_name,
                cache_salt=key.cache_salt,
                world_size=key.world_size,
            )
        )
        chunks = reader.retrieve(key, registration.instance_id, shm)
        reader.call("end_session", key.request_id)
        return hits, chunks


@pytest.mark.parametrize("other", [FP16, MLA], ids=["float16", "mla"])
def test_a_chunk_of_the_same_size_and_another_layout_is_a_counted_miss_in_l1(
    make_mp_server: Any, other: Registration
) -> None:
    assert other.object_bytes == BF16.object_bytes
    server = make_mp_server()
    payloads = chunk_payloads(41, CHUNKS, BF16.object_bytes)
    _store(server, BF16, Key(tokens_of(41), "w", worker_id=0), payloads)
    hits, chunks = _read(server, other, Key(tokens_of(41), "r", worker_id=0))
    assert hits == CHUNKS  # the keys are there; their layout is not the reader's
    assert chunks is None
    assert _failures(server)["mp_retrieve_layout_mismatch"] == 1
    assert server.storage.status()["l1"]["read_locks"] == 0


@pytest.mark.parametrize("other", [FP16, MLA], ids=["float16", "mla"])
def test_a_chunk_of_another_layout_loaded_from_a_shared_l2_is_a_counted_miss(
    make_mp_server: Any, tmp_path: Path, other: Registration
) -> None:
    """The layout a record states comes back into L1 with the chunk, so a chunk read from
    L2 is told from the reader's layout as one still in L1 is."""
    server = make_mp_server(adapters=_fs(tmp_path / "l2"))
    payloads = chunk_payloads(42, CHUNKS, BF16.object_bytes)
    _store(server, BF16, Key(tokens_of(42), "w", worker_id=0), payloads)
    _written_to_l2_and_cleared_from_l1(server)
    hits, chunks = _read(server, other, Key(tokens_of(42), "r", worker_id=0))
    assert hits == CHUNKS
    assert chunks is None
    assert _failures(server)["mp_retrieve_layout_mismatch"] == 1
    # and the layout it was stored with reads it back
    _written_to_l2_and_cleared_from_l1(server)
    hits, chunks = _read(server, BF16, Key(tokens_of(42), "r2", worker_id=0))
    assert (hits, chunks) == (CHUNKS, payloads)


@pytest.mark.parametrize(
    ("reader_key", "why"),
    [
        (Key(tokens_of(43), "r", worker_id=0, model_name="other-model"), "model"),
        (Key(tokens_of(43), "r", worker_id=0, cache_salt="tenant-b"), "salt"),
        (Key(tokens_of(43), "r", worker_id=1, world_size=2), "rank"),
        (Key(tokens_of(43), "r", worker_id=0, world_size=2), "world size"),
        (Key([43, 1, *tokens_of(43)[2:]], "r", worker_id=0), "tokens"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_another_model_salt_rank_or_token_prefix_never_hits_l2(
    make_mp_server: Any, tmp_path: Path, reader_key: Key, why: str
) -> None:
    server = make_mp_server(adapters=_fs(tmp_path / "l2"))
    _store(server, BF16, Key(tokens_of(43), "w", worker_id=0), chunk_payloads(43, CHUNKS, BF16.object_bytes))
    _written_to_l2_and_cleared_from_l1(server)
    registration = Registration(
        instance_id=2000, model_name=reader_key.model_name, world_size=reader_key.world_size
    )
    hits, chunks = _read(server, registration, reader_key)
    assert hits == 0, why
    assert chunks is None, why


def test_a_chunk_the_native_client_stored_as_a_tensor_is_refused_to_another_dtype(
    make_mp_server: Any,
) -> None:
    """A native client storing tensors sends their layout: an LMCache worker of another
    dtype (same size) misses, counted."""
    torch = pytest.importorskip("torch")
    server = make_mp_server()
    native = next(f.address for f in server.frontends if f.name.endswith(":native"))
    tokens = tokens_of(44)
    shape = (2, BF16.num_layers, 256, BF16.hidden_dim_size)
    tensors = [torch.full(shape, float(index), dtype=torch.bfloat16) for index in range(CHUNKS)]
    with Client(native) as writer:
        writer.store(prefix_keys(tokens, 256, model_name=BF16.model_name, kv_rank=kv_rank_of(1, 0)), tensors)
    hits, chunks = _read(server, FP16, Key(tokens, "r", worker_id=0))
    assert hits == CHUNKS
    assert chunks is None
    assert _failures(server)["mp_retrieve_layout_mismatch"] == 1
