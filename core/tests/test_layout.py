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
