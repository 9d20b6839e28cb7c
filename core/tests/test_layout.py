"""Tensor layouts: parsing, formatting, size checks, and what the client derives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_tiers.layout import TensorLayout, check_layout, layout_of, reader_layout_of


def test_round_trip_and_sizes() -> None:
    layout = TensorLayout.parse("bfloat16[2,32,256,1024]")
    assert layout == TensorLayout("bfloat16", (2, 32, 256, 1024))
    assert layout.format() == "bfloat16[2,32,256,1024]"
    assert layout.nbytes == 2 * 32 * 256 * 1024 * 2
    assert layout.is_float
    assert not TensorLayout.parse("uint8[16]").is_float
    assert TensorLayout.parse("float32[]").nbytes == 4  # a scalar


@pytest.mark.parametrize(
    "text", ["", "bfloat16", "bfloat16[2,x]", "complex64[2]", "float16[-1]", "float16[1,2,3,4,5,6,7,8,9]"]
)
def test_malformed_layouts_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        TensorLayout.parse(text)
    assert TensorLayout.parse_optional(text) is None


def test_check_layout_compares_with_the_object_size() -> None:
    check_layout("", 123)  # unknown layouts are always fine
    check_layout("float16[4,4]", 32)
    with pytest.raises(ValueError, match="describes 32 bytes"):
        check_layout("float16[4,4]", 33)


def test_layout_of_tensors_arrays_and_bytes() -> None:
    assert layout_of(torch.zeros((2, 3), dtype=torch.bfloat16)) == "bfloat16[2,3]"
    assert layout_of(torch.zeros((4,), dtype=torch.float8_e4m3fn)) == "float8_e4m3fn[4]"
    assert layout_of(np.zeros((5, 2), dtype=np.float32)) == "float32[5,2]"
    assert layout_of(np.zeros(3, dtype=np.complex64)) == ""  # no layout name for it
    assert layout_of(b"raw bytes") == ""
    assert layout_of(memoryview(bytearray(8))) == ""


@pytest.mark.parametrize("text", ["float16[2]\n", "float16[\u0662]", "float16[\uff14]"])
def test_only_the_canonical_ascii_form_is_read(text: str) -> None:
    # ``$`` matches before a final newline and ``\d`` matches any Unicode digit: neither
    # is the form a writer produces, so neither is a layout.
    with pytest.raises(ValueError):
        TensorLayout.parse(text)
    with pytest.raises(ValueError):
        check_layout(text, 4)


def test_non_native_byte_order_arrays_have_no_layout() -> None:
    # A quantizing serde reads the bytes as native numbers: big-endian float16 bytes
    # described as "float16" would be quantized as garbage.
    swapped = np.zeros((2, 3), dtype=np.float16).astype(np.dtype(np.float16).newbyteorder())
    assert not swapped.dtype.isnative
    assert layout_of(swapped) == ""
    assert layout_of(np.zeros(3, dtype=np.dtype(np.int8).newbyteorder())) == "int8[3]"  # one byte: no order


@pytest.mark.parametrize(
    "buffer",
    [
        torch.zeros((2, 3), dtype=torch.bfloat16),
        torch.zeros((2, 3), dtype=torch.float32).t(),  # non-contiguous: described as its copy
        np.zeros((2, 3), dtype=np.float16),
        np.zeros(4, dtype=">f4"),  # non-native: no layout
        np.zeros(4, dtype=np.int8),
        bytearray(8),
        memoryview(bytearray(8)),
    ],
)
def test_a_reader_names_the_layout_of_its_buffer(buffer: object) -> None:
    assert reader_layout_of(buffer) == layout_of(buffer)


@pytest.mark.parametrize("buffer", [torch.zeros((2, 8), dtype=torch.uint8), np.zeros((2, 8), dtype=np.uint8)])
def test_a_uint8_reader_reads_plain_bytes(buffer: object) -> None:
    assert layout_of(buffer) == "uint8[2,8]"  # what it is stored as
    assert reader_layout_of(buffer) == ""  # what it reads: any object's bytes


def _reader_layout_as_before(buffer: object) -> str:
    """The rule ``reader_layout_of`` replaced: the stored layout, "" for a uint8 one."""
    text = layout_of(buffer)
    return "" if text.startswith("uint8[") else text


class _ArraySubclass(np.ndarray):  # type: ignore[type-arg]
    pass


_TORCH_DTYPES = [
    getattr(torch, name)
    for name in (
        "uint8", "int8", "bool", "bfloat16", "float16", "float32", "float64", "int16", "int32", "int64",
        "complex64", "uint16", "uint32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e8m0fnu",
    )
    if hasattr(torch, name)
]  # fmt: skip
_NUMPY_DTYPES = [
    np.uint8, np.int8, np.bool_, np.float16, np.float32, np.float64, np.int64, np.uint16, np.complex64,
    ">u2", ">u1", "S4", "V4",
    # structured and sub-array dtypes
    np.dtype([("a", "u1")]), np.dtype(("u1", (4,))), np.dtype([("a", "<f2"), ("b", "u1")]),
]  # fmt: skip


@pytest.mark.parametrize(
    "buffer",
    [torch.zeros((2, 4), dtype=dtype) for dtype in _TORCH_DTYPES]
    + [torch.zeros((4, 2), dtype=dtype).t() for dtype in _TORCH_DTYPES]  # non-contiguous
    + [np.zeros((2, 4), dtype=dtype) for dtype in _NUMPY_DTYPES]
    + [
        np.zeros((4, 4), dtype=np.uint8)[:, ::2],  # non-contiguous
        np.zeros((4, 4), dtype=np.float16).T,
        np.zeros((1,) * 40, dtype=np.uint8),  # more dimensions than a layout may name
        np.zeros((1,) * 40, dtype=np.float16),
        torch.zeros((1,) * 40, dtype=torch.uint8),
        np.zeros(8, dtype=np.uint8).view(_ArraySubclass),
        np.zeros(8, dtype=np.float32).view(_ArraySubclass),
        torch.nn.Parameter(torch.zeros(4)),
        b"ab",
    ],
)
def test_a_reader_asks_for_what_it_asked_for_before(buffer: object) -> None:
    """Differential: every dtype (fp8, bf16, bool, structured and sub-array numpy dtypes,
    non-native byte order), non-contiguous views and subclasses name the layout they named
    when every buffer's layout was built first and uint8 ones dropped."""
    assert reader_layout_of(buffer) == _reader_layout_as_before(buffer)
