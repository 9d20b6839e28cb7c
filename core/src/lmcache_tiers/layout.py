"""Tensor layouts: the dtype and shape an object's bytes represent, when a writer knows them.

Objects are bytes to L1 and to every adapter; a layout is optional metadata a front end
attaches when it knows what the bytes are (a torch tensor handed to the client, the KV
layout an LMCache engine registered).  Serdes that transform numbers rather than bytes
(fp8 quantization, byte shuffling by element size) read it from their
:class:`~lmcache_tiers.serde.SerdeContext`.  On the wire and in records a layout is a
short string, ``"bfloat16[2,32,256,1024]"``; the empty string means "unknown".
"""

from __future__ import annotations

import functools
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "MAX_LAYOUT_LEN",
    "TensorLayout",
    "check_layout",
    "layout_of",
    "reader_layout_of",
]

#: element size in bytes of every dtype a layout may name (torch attribute names)
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}

#: dtypes holding floating-point numbers (what a quantizing serde can act on)
FLOAT_DTYPES = frozenset(name for name in DTYPE_SIZES if name.startswith(("float", "bfloat")))

#: longest layout string accepted from a client or a record
MAX_LAYOUT_LEN = 256
_MAX_DIMS = 8
# ASCII digits only, matched whole (``$`` would also match before a final newline): the
# one form ``format`` writes.
_PATTERN = re.compile(r"([a-z0-9_]+)\[(\d+(?:,\d+)*)?\]", re.ASCII)


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """A contiguous tensor of ``dtype`` with ``shape`` (row-major)."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(sorted(DTYPE_SIZES))}")
        if len(self.shape) > _MAX_DIMS or any(dim < 0 for dim in self.shape):
            raise ValueError(f"bad shape {list(self.shape)}: at most {_MAX_DIMS} non-negative dims")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def format(self) -> str:
        return f"{self.dtype}[{','.join(str(dim) for dim in self.shape)}]"

    @classmethod
    def parse(cls, text: str) -> TensorLayout:
        """Read ``"dtype[d0,d1,...]"``; raises ValueError for anything else."""
        if len(text) > MAX_LAYOUT_LEN:
            raise ValueError(f"layout is {len(text)} characters long; at most {MAX_LAYOUT_LEN}")
        match = _PATTERN.fullmatch(text)
        if match is None:
            raise ValueError(f"layout {text!r} is not of the form dtype[d0,d1,...]")
        dims = match.group(2)
        return cls(match.group(1), tuple(int(d) for d in dims.split(",")) if dims else ())

    @classmethod
    def parse_optional(cls, text: str) -> TensorLayout | None:
        """``parse`` for stored metadata: None for "" and for anything unreadable."""
        if not text:
            return None
        try:
            return cls.parse(text)
        except ValueError:
            return None


# A request's chunks share one layout, and a client stores the same few shapes again and
# again: parsing and formatting each chunk's layout anew cost more per chunk of a large
# STORE than the rest of the client's bookkeeping.  Only valid layouts are remembered
# (lru_cache keeps no exceptions).
_LAYOUTS_REMEMBERED = 1024


@functools.lru_cache(maxsize=_LAYOUTS_REMEMBERED)
def _layout_bytes(text: str) -> int:
    return TensorLayout.parse(text).nbytes


@functools.lru_cache(maxsize=_LAYOUTS_REMEMBERED)
def _layout_text(dtype: str, shape: tuple[int, ...]) -> str:
    if dtype not in DTYPE_SIZES or len(shape) > _MAX_DIMS:
        return ""
    return TensorLayout(dtype, shape).format()


@functools.lru_cache(maxsize=64)
def _numpy_dtype_name(dtype: Any) -> str:
    return str(dtype.name)  # numpy computes the name in Python on every access


@functools.lru_cache(maxsize=64)
def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")  # str() of a dtype is built in Python


def check_layout(text: str, size: int) -> None:
    """Raise ValueError unless ``text`` is "" or a layout of exactly ``size`` bytes."""
    if not text:
        return
    nbytes = _layout_bytes(text)
    if nbytes != size:
        raise ValueError(f"layout {text} describes {nbytes} bytes, the object has {size}")


def layout_of(buffer: object) -> str:
    """The layout string of a torch tensor or numpy array, "" for plain bytes.

    What a client sends with an object it stores, so that serdes know the numbers behind
    the bytes.  Non-contiguous tensors are described as the contiguous copy the client
    stores.
    """
    # Only modules the caller already imported can have produced the buffer: looking them
    # up keeps this module (imported by every plugin manifest) free of heavy imports.
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    if torch is not None and isinstance(buffer, torch.Tensor):
        return _tensor_layout(buffer)
    if numpy is not None and isinstance(buffer, numpy.ndarray):
        return _array_layout(buffer)
    return ""


def reader_layout_of(buffer: object) -> str:
    """What a reader of ``buffer`` asks objects to be: :func:`layout_of` it, or "" for a
    uint8 tensor or array, which takes any object as plain bytes (as a bytearray does).

    Every ``retrieve_into`` buffer passes here, so the dtype is looked at before any
    layout is built, and numpy (a C-level type check) is tried before torch (whose
    tensor type check runs Python code)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(buffer, numpy.ndarray):
        return "" if buffer.dtype.char == "B" else _array_layout(buffer)  # "B": uint8
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        return "" if buffer.dtype is torch.uint8 else _tensor_layout(buffer)
    return ""


def _tensor_layout(tensor: Any) -> str:
    return _layout_text(_torch_dtype_name(tensor.dtype), tuple(map(int, tensor.shape)))


def _array_layout(array: Any) -> str:
    if not array.dtype.isnative:
        return ""  # serdes read numbers in native byte order: these bytes are not
    return _layout_text(_numpy_dtype_name(array.dtype), array.shape)  # shape: a tuple of ints
