"""What a store does per chunk before and after its reservation, which a store of many
small chunks pays for chunk by chunk: a flat uint8 array is stored from itself (no view
made of it), each distinct (layout, size) pair is checked once, and the slots the server
names are checked in one call per request; none of it lets a wrong layout or slot through."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from lmcache_tiers.client import Client, ProtocolError
from lmcache_tiers.client import api as client_api
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.shm import MappedSegment, as_byte_array


def keys_of(count: int) -> list[ObjectKey]:
    salt = os.urandom(6)
    return [ObjectKey("unit", 0, salt + bytes([index])) for index in range(count)]


def test_a_flat_uint8_array_is_its_own_byte_view_and_others_are_viewed_flat() -> None:
    flat = np.arange(64, dtype=np.uint8)
    assert as_byte_array(flat) is flat
    numbers = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    viewed = as_byte_array(numbers)
    assert viewed.dtype == np.uint8 and viewed.shape == (48,) and np.shares_memory(viewed, numbers)
    assert viewed.tobytes() == numbers.tobytes()
    strided = np.arange(32, dtype=np.uint8)[::2]  # not contiguous: a contiguous copy
    assert as_byte_array(strided).tobytes() == strided.tobytes()
    matrix = np.asarray(np.arange(6, dtype=np.uint8).reshape(2, 3)).view(np.matrix)  # a subclass
    assert as_byte_array(matrix).shape == (6,)


def test_a_store_checks_each_layout_and_size_once(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[tuple[str, int]] = []
    real_check = client_api.check_layout  # type: ignore[attr-defined]

    def counting_check(text: str, size: int) -> None:
        checked.append((text, size))
        real_check(text, size)

    monkeypatch.setattr(client_api, "check_layout", counting_check)
    chunks = [np.full(256, index, dtype=np.uint8) for index in range(16)] + [np.zeros((4, 8), np.float16)]
    keys = keys_of(len(chunks))
    with Client(server.endpoint) as client:
        assert client.store(keys, chunks) == len(chunks)
        assert checked == [("uint8[256]", 256), ("float16[4,8]", 64)]
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == [chunk.tobytes() for chunk in chunks]
        # A layout given that does not fit its bytes is still refused, the first one at fault named.
        layouts = ["uint8[64]", "uint8[64]", "uint8[63]", "uint8[62]"]
        more = keys_of(4)
        with pytest.raises(ValueError, match=r"layout uint8\[63\] describes 63 bytes"):
            client.store(more, [bytes(64)] * 4, layouts=layouts)
        assert client.lookup(more) == 0


def test_a_slot_outside_the_arena_aborts_the_store_unwritten(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks: list[int] = []
    real_check_slots = MappedSegment.check_slots

    def counting_check_slots(segment: MappedSegment, slots: Any) -> None:
        checks.append(len(list(slots)))
        real_check_slots(segment, slots)

    monkeypatch.setattr(MappedSegment, "check_slots", counting_check_slots)
    keys = keys_of(8)
    with Client(server.endpoint) as client:
        assert client.uses_shm
        assert client.store(keys, [bytes([index]) * 512 for index in range(8)]) == 8
        assert checks == [8]  # one call for the request's slots

        real_call = client._call
        segment = client._segment
        assert segment is not None

        reserved: list[p.Slot] = []

        def reserve_past_the_end(request: Any, expect: Any, *args: Any, **kwargs: Any) -> Any:
            reply = real_call(request, expect, *args, **kwargs)
            if isinstance(request, p.StoreReserve):
                reserved.extend(reply.slots)
                last = reply.slots[-1]
                reply.slots[-1] = p.Slot(segment.data_size - 100, last.size, last.generation)
            return reply

        monkeypatch.setattr(client, "_call", reserve_past_the_end)
        more = keys_of(3)
        with pytest.raises(ProtocolError, match="the server named slot"):
            client.store(more, [b"z" * 512] * 3)
        monkeypatch.setattr(client, "_call", real_call)
        # refused before any copy: the slots in the arena were not written either
        assert len(reserved) == 3
        for slot in reserved[:2]:
            assert segment.array[slot.offset : slot.offset + slot.size].tobytes() != b"z" * 512
        assert client.lookup(more) == 0  # aborted: none committed
        assert client.store(more, [b"z" * 512] * 3) == 3


def test_a_contiguous_cpu_tensor_is_viewed_as_bytes_without_the_general_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # detach, contiguous and a flat reshape cost a microsecond each per chunk: a tensor
    # that is already contiguous and needs no grad is viewed as its bytes directly.
    tensor = torch.arange(64, dtype=torch.float32).to(torch.bfloat16).reshape(2, 4, 8)
    want = tensor.view(torch.int16).numpy().tobytes()
    for method in ("detach", "contiguous"):
        monkeypatch.setattr(torch.Tensor, method, lambda self, *args, **kwargs: pytest.fail("general path"))
    viewed = as_byte_array(tensor)
    assert viewed.dtype == np.uint8 and viewed.shape == (128,) and viewed.tobytes() == want
    assert np.shares_memory(viewed, tensor.view(torch.uint8).numpy())  # a view, not a copy


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),  # 0-dim: no byte view of it
        torch.ones(4, requires_grad=True),  # numpy refuses a tensor needing grad
        torch.arange(12, dtype=torch.int16).reshape(3, 4).T,  # not contiguous: copied
        torch.arange(10, dtype=torch.int16)[2:],  # contiguous, at an offset in its storage
        torch.tensor([True, False, True]),
        # contiguous by torch's rules (a dimension of one element has any stride), yet its
        # last stride is 4, which view(torch.uint8) refuses for a 2-byte dtype
        torch.arange(4, dtype=torch.float32).to(torch.bfloat16).reshape(1, 4).T,
    ],
    ids=["0-dim", "requires-grad", "transposed", "offset", "bool", "transposed-row"],
)
def test_every_tensor_is_viewed_as_its_row_major_bytes(tensor: torch.Tensor) -> None:
    want = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    viewed = as_byte_array(tensor)
    assert viewed.dtype == np.uint8 and viewed.ndim == 1 and viewed.tobytes() == want


def test_a_transposed_row_is_stored_and_retrieved_into(server: TiersServer) -> None:
    # A column made by transposing a row is contiguous to torch but cannot be viewed as
    # bytes directly: it is stored, and retrieved into, through the general path.
    column = torch.arange(64, dtype=torch.float32).to(torch.bfloat16).reshape(1, 64).T
    assert column.is_contiguous() and column.stride(-1) != 1
    keys = keys_of(1)
    with Client(server.endpoint) as client:
        assert client.store(keys, [column]) == 1
        assert client.lookup(keys) == 1
        into = torch.zeros(64, dtype=torch.bfloat16).reshape(1, 64).T
        assert client.retrieve_into(keys, [into]) == 1
    assert torch.equal(into, column)


def test_a_tensor_on_another_device_is_refused_before_any_request(server: TiersServer) -> None:
    # No accelerator here: a meta tensor stands for one (is_cpu is False for both), and
    # must never reach numpy, which would read or write host memory at its address.
    elsewhere = torch.zeros(2, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(TypeError, match="only CPU tensors can be stored directly, got one on meta"):
        as_byte_array(elsewhere)
    keys = keys_of(2)
    with Client(server.endpoint) as client:
        with pytest.raises(TypeError, match="only CPU tensors"):
            client.store(keys, [torch.zeros(2, 64, dtype=torch.bfloat16), elsewhere])
        assert client.lookup(keys) == 0  # refused whole, the CPU chunk beside it too
        with pytest.raises(TypeError, match="only CPU tensors"):
            client.retrieve_into(keys, [elsewhere, elsewhere])
