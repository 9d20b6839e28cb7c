"""A reader copying into tensors gets a chunk only if the chunk is of their layout.

The key names model, rank, salt and tokens, not the dtype or shape of the bytes: two
engines of one model in other dtypes (vLLM's ``--dtype``) derive the same keys.  The
layout a writer stored with is kept with the object (and in its L2 record); a reader that
names its own layout -- ``retrieve_into`` does for torch tensors and numpy arrays -- gets a
counted miss for an object of another known layout, never bytes it would read as other
numbers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from lmcache_tiers.client import Client
from lmcache_tiers.keys import prefix_keys
from lmcache_tiers.layout import layout_of
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.testing.server import ServerHarness, until_reachable

SHAPE = (2, 4, 256, 64)
CHUNKS = 3
KEYS = prefix_keys(list(range(CHUNKS * 256)), 256, model_name="m", kv_rank=0x01000100)


def _native(server: TiersServer) -> Any:
    return next(frontend for frontend in server.frontends if frontend.name.endswith(":native"))


def _stored_bf16(server: TiersServer, *, shm: bool) -> list[torch.Tensor]:
    tensors = [torch.full(SHAPE, 1.5 + index, dtype=torch.bfloat16) for index in range(CHUNKS)]
    with Client(_native(server).address, shm=shm) as writer:
        assert writer.store(KEYS, tensors) == CHUNKS
    return tensors


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
@pytest.mark.parametrize(
    "reader",
    [
        lambda: torch.zeros(SHAPE, dtype=torch.float16),  # the same size
        lambda: torch.zeros(SHAPE, dtype=torch.float32),  # twice the size
        lambda: np.zeros((4, 256, 128), dtype=np.float16),  # another shape, the same size
    ],
    ids=["float16", "float32", "mla-shaped"],
)
def test_a_reader_of_another_layout_gets_a_counted_miss(make_server: Any, shm: bool, reader: Any) -> None:
    server = make_server()
    stored = _stored_bf16(server, shm=shm)
    targets = [reader() for _ in range(CHUNKS)]
    with Client(_native(server).address, shm=shm) as client:
        assert client.retrieve_into(KEYS, targets) == 0
        assert all(not bool(np.asarray(target).any()) for target in targets)  # nothing copied
        # the layout it was stored with reads it
        same = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(CHUNKS)]
        assert client.retrieve_into(KEYS, same) == CHUNKS
        assert all(torch.equal(got, want) for got, want in zip(same, stored, strict=True))
    assert _native(server).stats().failures["retrieve_layout_mismatch"] == 1
    assert server.storage.status()["l1"]["read_locks"] == 0


def test_the_prefix_ends_at_the_first_chunk_of_another_layout(make_server: Any) -> None:
    server = make_server()
    stored = _stored_bf16(server, shm=True)
    targets = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(CHUNKS)]
    targets[1] = torch.zeros(SHAPE, dtype=torch.float16)
    with Client(_native(server).address) as client:
        assert client.retrieve_into(KEYS, targets) == 1
    assert torch.equal(targets[0], stored[0])
    assert not targets[1].any() and not targets[2].any()
    assert server.storage.status()["l1"]["read_locks"] == 0


def test_plain_buffers_and_unknown_layouts_are_served_as_bytes(make_server: Any) -> None:
    """A reader that names no layout (a bytearray, a uint8 array) gets the bytes; so does
    a reader of an object stored without one, when the sizes agree."""
    server = make_server()
    _stored_bf16(server, shm=True)
    plain = prefix_keys(list(range(256)), 256, model_name="plain", kv_rank=0)
    data = bytes(range(256)) * (torch.zeros(SHAPE, dtype=torch.bfloat16).nbytes // 256)
    with Client(_native(server).address) as client:
        assert client.store(plain, [data]) == 1
        raw = [bytearray(len(data)) for _ in range(CHUNKS)]
        assert client.retrieve_into(KEYS, raw) == CHUNKS
        as_bytes = [np.zeros(len(data), dtype=np.uint8), torch.zeros(len(data) * 2, dtype=torch.uint8)]
        assert client.retrieve_into(KEYS[:2], as_bytes) == 2  # uint8: plain bytes, any size as before
        into = torch.zeros(SHAPE, dtype=torch.float16)
        assert client.retrieve_into(plain, [into]) == 1
        assert into.view(torch.uint8).numpy().tobytes() == data
        # an unknown layout of another size than the reader's tensor is no chunk of it
        assert client.retrieve_into(plain, [torch.zeros(SHAPE, dtype=torch.float32)]) == 0
    assert _native(server).stats().failures["retrieve_layout_mismatch"] == 1


def test_a_chunk_read_back_from_l2_keeps_its_layout(make_server: Any, tmp_path: Path) -> None:
    server = make_server(adapters=[json.dumps({"type": "fs", "path": str(tmp_path / "l2")})])
    stored = _stored_bf16(server, shm=True)
    assert server.storage.flush(timeout=30)
    with Client(_native(server).address) as client:
        client.clear(force=True)
        assert server.storage.status()["l1"]["objects"] == 0
        assert client.lookup(KEYS, timeout=10) == CHUNKS  # loaded from L2, locked for this client
        assert client.retrieve_into(KEYS, [torch.zeros(SHAPE, dtype=torch.float16)] * CHUNKS) == 0
        assert client.lookup(KEYS, timeout=10) == CHUNKS
        same = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(CHUNKS)]
        assert client.retrieve_into(KEYS, same) == CHUNKS
        assert all(torch.equal(got, want) for got, want in zip(same, stored, strict=True))
    assert _native(server).stats().failures["retrieve_layout_mismatch"] == 1
    assert server.storage.status()["l1"]["read_locks"] == 0


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
def test_views_are_refused_to_a_reader_naming_another_layout(make_server: Any, shm: bool) -> None:
    server = make_server()
    stored = _stored_bf16(server, shm=shm)
    bf16 = f"bfloat16[{','.join(map(str, SHAPE))}]"
    with Client(_native(server).address, shm=shm) as client:
        with client.retrieve(KEYS, layouts=[bf16.replace("bfloat16", "float16")] * CHUNKS) as views:
            assert views == []
        with client.retrieve(KEYS, layouts=[bf16] * CHUNKS) as views:
            assert [bytes(view) for view in views] == [t.view(torch.uint8).numpy().tobytes() for t in stored]
    assert _native(server).stats().failures["retrieve_layout_mismatch"] == 1
    assert server.storage.status()["l1"]["read_locks"] == 0


def test_a_mismatch_behind_an_inline_reply_cut_by_its_byte_limit_is_counted_once(make_server: Any) -> None:
    """Inline replies carry one chunk each here: the client asks again from where each
    stopped, and the chunk of another layout ends the prefix once, not once per reply."""
    chunk_bytes = torch.zeros(SHAPE, dtype=torch.bfloat16).nbytes
    server = make_server(frontends=[{"type": "native", "max_inline_bytes": chunk_bytes}])
    stored = _stored_bf16(server, shm=False)
    targets = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(CHUNKS)]
    targets[2] = torch.zeros(SHAPE, dtype=torch.float16)
    with Client(_native(server).address, shm=False) as client:
        assert client.retrieve_into(KEYS, targets) == 2
    assert all(torch.equal(got, want) for got, want in zip(targets[:2], stored, strict=False))
    assert _native(server).stats().failures["retrieve_layout_mismatch"] == 1
    assert server.storage.status()["l1"]["read_locks"] == 0


def test_views_are_refused_by_a_server_upgraded_since_the_client_greeted_its_predecessor() -> None:
    """A rolling upgrade: the client greeted a server without ``retrieve_layouts`` (this
    release's, greeted as an earlier one announces itself), which was then replaced by
    this release on the same port.  The first retrieve after the switch must name the
    reader's layouts to the new server, not decide from the old server's HELLO."""
    port = free_port()
    first, second = ServerHarness(), ServerHarness()
    try:
        client = Client(first.make(port=port).endpoint, timeout=5)
        earlier = [feature for feature in client.server.features if feature != "retrieve_layouts"]
        client.server = msgspec.structs.replace(client.server, features=earlier)
        first.close()
        upgraded = second.make(port=port)
        _stored_bf16(upgraded, shm=True)
        until_reachable(client)
        float16 = f"float16[{','.join(map(str, SHAPE))}]"
        with client.retrieve(KEYS, layouts=[float16] * CHUNKS) as views:
            assert views == []
        assert "retrieve_layouts" in client.server_features
        client.close()
        assert _native(upgraded).stats().failures["retrieve_layout_mismatch"] == 1
        assert upgraded.storage.status()["l1"]["read_locks"] == 0
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
def test_a_client_says_once_that_a_server_of_an_earlier_release_cannot_check_layouts(
    make_server: Any, shm: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Against a server without ``retrieve_layouts`` the reader's layouts go unchecked and
    a chunk of another dtype is copied as before: a skipped check, so the client logs it
    (once per server greeted, not per call), and not for readers of plain bytes."""
    server = make_server()
    _stored_bf16(server, shm=shm)
    with Client(_native(server).address, shm=shm) as client:
        earlier = [feature for feature in client.server.features if feature != "retrieve_layouts"]
        client.server = msgspec.structs.replace(client.server, features=earlier)
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers.client"):
            assert client.retrieve_into(KEYS, [bytearray(torch.zeros(SHAPE).nbytes)] * CHUNKS) == CHUNKS
            assert "retrieve_layouts" not in caplog.text  # plain bytes: nothing went unchecked
            for _ in range(2):
                float16 = [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(CHUNKS)]
                assert client.retrieve_into(KEYS, float16) == CHUNKS  # copied, as earlier releases do
                with client.retrieve(KEYS, layouts=[layout_of(float16[0])] * CHUNKS) as views:
                    assert len(views) == CHUNKS
    unchecked = [record for record in caplog.records if "retrieve_layouts" in record.getMessage()]
    assert len(unchecked) == 1
    assert client.url in unchecked[0].getMessage()
    assert "retrieve_layout_mismatch" not in _native(server).stats().failures
