"""Client.retrieve_into names the reader's layout only where it matters: for a typed
buffer (not uint8, which reads plain bytes), to a server that checks layouts (feature
``retrieve_layouts``) -- and builds no layout for the other buffers and servers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from lmcache_tiers import layout
from lmcache_tiers.client import Client
from lmcache_tiers.keys import prefix_keys
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

SHAPE = (2, 8, 64)
CHUNKS = 2
KEYS = prefix_keys(list(range(CHUNKS * 256)), 256, model_name="reader-layouts", kv_rank=0)
FLOAT16 = f"float16[{','.join(map(str, SHAPE))}]"


def _stored_float16(server: TiersServer) -> list[np.ndarray[Any, Any]]:
    arrays = [np.full(SHAPE, 0.5 + index, dtype=np.float16) for index in range(CHUNKS)]
    with Client(server.endpoint) as writer:
        assert writer.store(KEYS, arrays) == CHUNKS
    return arrays


def _spied(client: Client, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[str]], list[object]]:
    """The ``layouts`` of every RETRIEVE ``client`` sends, and every layout text built
    (of a tensor's or array's dtype and shape) meanwhile."""
    sent: list[list[str]] = []
    built: list[tuple[str, tuple[int, ...]]] = []
    real_call, real_exchange, real_layout_text = client._call, client._exchange, layout._layout_text

    def call(request: p._Request, *args: Any, **kwargs: Any) -> Any:
        if isinstance(request, p.Retrieve):
            sent.append(list(request.layouts))
        return real_call(request, *args, **kwargs)

    def exchange(request: p._Request, *args: Any, **kwargs: Any) -> Any:  # inline retrieves
        if isinstance(request, p.Retrieve):
            sent.append(list(request.layouts))
        return real_exchange(request, *args, **kwargs)

    def layout_text(dtype: str, shape: tuple[int, ...]) -> str:
        built.append((dtype, shape))
        return real_layout_text(dtype, shape)

    client._call = call  # type: ignore[method-assign]
    client._exchange = exchange  # type: ignore[method-assign]
    monkeypatch.setattr(layout, "_layout_text", layout_text)
    return sent, built


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
@pytest.mark.parametrize(
    "reader",
    [lambda nbytes: np.zeros(nbytes, dtype=np.uint8), lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8)],
    ids=["numpy", "torch"],
)
def test_a_uint8_reader_reads_plain_bytes_and_builds_no_layout(
    make_server: Callable[..., TiersServer],
    monkeypatch: pytest.MonkeyPatch,
    shm: bool,
    reader: Callable[[int], Any],
) -> None:
    server = make_server()
    stored = _stored_float16(server)
    with Client(server.endpoint, shm=shm) as client:
        sent, built = _spied(client, monkeypatch)
        targets = [reader(array.nbytes) for array in stored]
        assert client.retrieve_into(KEYS, targets) == CHUNKS
    assert [bytes(np.asarray(target)) for target in targets] == [array.tobytes() for array in stored]
    assert sent and all(layouts == [] for layouts in sent)
    assert built == []


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
def test_a_typed_reader_sends_its_layout(
    make_server: Callable[..., TiersServer], monkeypatch: pytest.MonkeyPatch, shm: bool
) -> None:
    server = make_server()
    stored = _stored_float16(server)
    with Client(server.endpoint, shm=shm) as client:
        sent, built = _spied(client, monkeypatch)
        same = [np.zeros(SHAPE, dtype=np.float16) for _ in range(CHUNKS)]
        assert client.retrieve_into(KEYS, same) == CHUNKS
        assert sent[-1] == [FLOAT16] * CHUNKS
        assert built == [("float16", SHAPE)] * CHUNKS
        other = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(CHUNKS)]
        assert client.retrieve_into(KEYS, other) == 0  # same size, other numbers: a miss
        assert sent[-1] == [FLOAT16.replace("float16", "bfloat16")] * CHUNKS
    assert all(np.array_equal(got, want) for got, want in zip(same, stored, strict=True))
    assert not any(bool(target.any()) for target in other)
    assert server.storage.status()["l1"]["read_locks"] == 0


def test_no_layout_is_built_for_a_server_that_cannot_check_them(
    make_server: Callable[..., TiersServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server of an earlier release (greeted without ``retrieve_layouts``) serves the
    bytes as before: the client names no layout, so it builds none."""
    server = make_server()
    stored = _stored_float16(server)
    with Client(server.endpoint) as client:
        earlier = [feature for feature in client.server.features if feature != "retrieve_layouts"]
        client.server = msgspec.structs.replace(client.server, features=earlier)
        client._follow_server = lambda: None  # type: ignore[method-assign]  # keep the earlier greeting
        sent, built = _spied(client, monkeypatch)
        targets = [np.zeros(SHAPE, dtype=np.float16) for _ in range(CHUNKS)]
        assert client.retrieve_into(KEYS, targets) == CHUNKS
    assert all(np.array_equal(got, want) for got, want in zip(targets, stored, strict=True))
    assert sent and all(layouts == [] for layouts in sent)
    assert built == []
