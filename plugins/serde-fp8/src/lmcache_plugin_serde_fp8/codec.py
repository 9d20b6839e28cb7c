"""The ``fp8`` serde: scaled fp8 quantization of an object's tensor.

Frame layout (little-endian)::

    magic "LTF8" | version u8 | format u8 | granularity u8 | reserved u8 | layout_len u16
    | reserved u16 | scale_count u32 | payload_len u64 | xxh3_64 u64
    | layout (utf-8) | scales (float32 x scale_count) | payload

``format`` 0 is a passthrough frame: the payload is the object as it was (no layout, no
scales).  Otherwise the payload holds one fp8 byte per element of ``layout`` (the original
dtype and shape, which decode restores without being told) and ``x = q * scale`` recovers
each value, with one scale per tensor or per channel (last dimension).  The checksum
covers the 24 header bytes before it and everything after it and is verified before the
frame is interpreted, so a damaged frame is refused rather than dequantized into wrong
numbers; a quantized frame whose layout is not the one the object's record states is
refused as well (the loaded object gets the record's layout).

Quantization: ``scale = amax / max_finite(format)`` (amax of the tensor or of the channel;
1 where amax is 0), ``q = round_to_nearest(x / scale)`` computed in float32.  Work is done
in slices of about ``_SLICE_ELEMENTS`` so temporaries stay small and cache-resident; with
one scale per tensor, decoding is a gather from a 256-entry table of ``q * scale``.
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
from collections import Counter
from typing import Final, NoReturn

# torch's OpenMP workers spin between parallel regions by default.  Next to the server's
# own threads on busy cores that spinning starves everyone: on this project's 2-core
# machine under load, fp8 ran at ~0.3 GB/s with spinning workers and ~1.8 GB/s without.
# Only effective if torch is not imported yet; an operator's own setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import xxhash

from lmcache_plugin_serde_fp8 import Fp8Config
from lmcache_tiers.plugin import SerdeContext, TensorLayout

log = logging.getLogger("lmcache_tiers.serde.fp8")

MAGIC: Final = b"LTF8"
VERSION: Final = 1
PASSTHROUGH: Final = 0
FORMATS: Final = {"e4m3fn": 1, "e5m2": 2}
_FP8_DTYPES: Final = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}
GRANULARITIES: Final = {"tensor": 1, "channel": 2}
_HEADER = struct.Struct("<4sBBBBHHIQQ")
HEADER_SIZE: Final = _HEADER.size
_CHECKED = HEADER_SIZE - 8
_MAX_LAYOUT: Final = 256
#: the dtypes this serde quantizes (torch attribute names, as in layouts)
QUANTIZABLE: Final = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_FLOAT32_MAX: Final = float(torch.finfo(torch.float32).max)
_FLOAT32_TINY: Final = float(torch.finfo(torch.float32).tiny)
_SLICE_ELEMENTS: Final = 1 << 18

#: what ``stats()`` reports; every ``passthrough_*`` is an object stored unquantized
COUNTERS: Final = (
    "quantized_objects",
    "passthrough_no_layout",
    "passthrough_layout_mismatch",
    "passthrough_not_float",
    "passthrough_empty",
    "passthrough_non_finite",
    "passthrough_not_smaller",
    "decoded_objects",
    "corrupt_frames",
    "layout_mismatch",
    "newer_frames",
)
_WHY = {
    "passthrough_no_layout": "it has no tensor layout",
    "passthrough_layout_mismatch": "its layout does not describe these bytes (an earlier serde changed them)",
    "passthrough_not_float": "its dtype is not float64/float32/float16/bfloat16",
    "passthrough_empty": "it has no elements",
    "passthrough_non_finite": "it holds inf or nan, or magnitudes beyond float32",
    "passthrough_not_smaller": "quantized it would not be smaller",
}


class Fp8FrameError(ValueError):
    """The bytes are not an intact frame of this serde."""


class Fp8NewerFrameError(Fp8FrameError):
    """A frame of a later version than this release reads: written by a newer release
    sharing the store, not damage."""


class Fp8LayoutMismatchError(Fp8FrameError):
    """An intact quantized frame of another layout than the object's record states."""


def _digest(frame: memoryview) -> int:
    state = xxhash.xxh3_64()
    state.update(frame[:_CHECKED])
    state.update(frame[HEADER_SIZE:])
    return int(state.intdigest())


def _writable(view: memoryview) -> memoryview:
    # torch.frombuffer warns once per process about read-only buffers (and would let a
    # tensor write into them); a read-only input is copied instead.
    return memoryview(bytearray(view)) if view.readonly else view


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    channels = shape[-1] if shape else 1
    return (math.prod(shape) // channels if channels else 0), channels


class Fp8Serde:
    """fp8 quantization of float tensors; see the module docstring for the frame."""

    name = "fp8"

    def __init__(self, config: Fp8Config | None = None) -> None:
        self.config = config or Fp8Config()
        self._format = FORMATS[self.config.format or "e4m3fn"]
        self._granularity = GRANULARITIES[self.config.granularity]
        self._fp8 = _FP8_DTYPES[self._format]
        self._fp8_max = float(torch.finfo(self._fp8).max)
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._explained: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Fp8Serde(format={self.config.format!r}, granularity={self.config.granularity!r})"

    # -- Serde ------------------------------------------------------------------------------

    def max_encoded_size(self, size: int) -> int:
        # A quantized frame is only written when it is smaller than the passthrough frame.
        return HEADER_SIZE + size

    def encode(self, data: memoryview, context: SerdeContext) -> memoryview:
        view = memoryview(data).cast("B")
        layout = context.tensor_layout
        if layout is None:
            return self._passthrough(view, "passthrough_no_layout", context)
        if layout.nbytes != view.nbytes or view.nbytes != context.size:
            # The layout describes the object's L1 bytes; bytes of another size (the output
            # of an earlier serde) are not that tensor, and a quantized frame must decode
            # to exactly the object's size (the decoder refuses any other).
            return self._passthrough(view, "passthrough_layout_mismatch", context)
        dtype = QUANTIZABLE.get(layout.dtype)
        if dtype is None:
            return self._passthrough(view, "passthrough_not_float", context)
        if layout.numel == 0:
            return self._passthrough(view, "passthrough_empty", context)
        rows, channels = _rows(layout.shape)
        scale_count = channels if self._granularity == GRANULARITIES["channel"] else 1
        layout_text = layout.format().encode()
        frame_size = HEADER_SIZE + len(layout_text) + 4 * scale_count + layout.numel
        if frame_size >= HEADER_SIZE + view.nbytes:
            return self._passthrough(view, "passthrough_not_smaller", context)
        values = torch.frombuffer(_writable(view), dtype=dtype).view(rows, channels)
        scales = self._scales(values, scale_count)
        if scales is None:
            return self._passthrough(view, "passthrough_non_finite", context)
        frame = bytearray(frame_size)
        out = memoryview(frame)
        start = HEADER_SIZE + len(layout_text)
        out[HEADER_SIZE:start] = layout_text
        torch.frombuffer(frame, dtype=torch.float32, offset=start, count=scale_count).copy_(scales)
        payload_start = start + 4 * scale_count
        quantized = torch.frombuffer(frame, dtype=torch.uint8, offset=payload_start, count=layout.numel)
        self._quantize(values, quantized.view(self._fp8).view(rows, channels), scales)
        self._seal(out, self._format, len(layout_text), scale_count, layout.numel)
        self._count("quantized_objects")
        return out

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        view = memoryview(data).cast("B")
        try:
            return self._decode(view, context.size, context.record_layout)
        except Fp8FrameError as exc:
            self._count(_counter_of(exc))
            log.debug("fp8: refused the frame of %s: %s", context.key, exc)
            raise

    def stats(self) -> dict[str, int]:
        """Objects quantized, stored unquantized (by reason), decoded, and frames refused."""
        with self._lock:
            return dict(self._counters)

    # -- encoding ---------------------------------------------------------------------------

    def _scales(self, values: torch.Tensor, scale_count: int) -> torch.Tensor | None:
        """float32 scales (one, or one per channel); None if a value is not finite."""
        if scale_count == 1:
            low, high = torch.aminmax(values)
            amax = torch.maximum(-low, high).to(torch.float64).reshape(1)
        else:
            # Column-wise aminmax is slow on CPU; |x| then amax, slice by slice, is not.
            amax = torch.zeros(scale_count, dtype=values.dtype)
            step = self._step(scale_count)
            for row in range(0, values.shape[0], step):
                torch.maximum(amax, values[row : row + step].abs().amax(dim=0), out=amax)
            amax = amax.to(torch.float64)
        if not bool(torch.isfinite(amax).all()) or float(amax.max()) > _FLOAT32_MAX:
            return None
        # amax 0: all zeros, any scale works.  A tiny amax is clamped so 1/scale stays finite.
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        return (amax / self._fp8_max).clamp_min(_FLOAT32_TINY).to(torch.float32)

    @staticmethod
    def _step(channels: int) -> int:
        """Rows per slice of about ``_SLICE_ELEMENTS`` values."""
        return max(1, _SLICE_ELEMENTS // max(1, channels))

    def _quantize(self, values: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
        inverse = scales.reciprocal()
        step = self._step(values.shape[1])
        for row in range(0, values.shape[0], step):
            chunk = values[row : row + step]
            if chunk.dtype == torch.float32:
                # ``to`` would return the caller's (L1) bytes themselves: never scale in place.
                scaled = torch.mul(chunk, inverse)
            else:
                scaled = chunk.to(torch.float32).mul_(inverse)
            out[row : row + step].copy_(scaled)

    def _passthrough(self, view: memoryview, reason: str, context: SerdeContext) -> memoryview:
        frame = bytearray(HEADER_SIZE + view.nbytes)
        out = memoryview(frame)
        out[HEADER_SIZE:] = view
        self._seal(out, PASSTHROUGH, 0, 0, view.nbytes)
        self._count(reason)
        self._explain(reason, context)
        return out

    def _seal(self, frame: memoryview, fmt: int, layout_len: int, scale_count: int, payload_len: int) -> None:
        granularity = self._granularity if fmt != PASSTHROUGH else 0
        _HEADER.pack_into(
            frame, 0, MAGIC, VERSION, fmt, granularity, 0, layout_len, 0, scale_count, payload_len, 0
        )
        struct.pack_into("<Q", frame, _CHECKED, _digest(frame))

    # -- decoding ---------------------------------------------------------------------------

    def _decode(self, view: memoryview, size: int, record_layout: str) -> memoryview:
        if view.nbytes < HEADER_SIZE:
            _refuse(f"{view.nbytes} bytes is shorter than an fp8 frame header")
        magic, version, fmt, granularity, _r1, layout_len, _r2, scale_count, payload_len, checksum = (
            _HEADER.unpack_from(view)
        )
        if magic == MAGIC and version > VERSION and _digest(view) == checksum:
            # Kept in the store: the servers already upgraded read it.  Later versions keep
            # this header prefix and checksum rule, so the checksum tells such a frame from
            # one of this version whose version field a flipped bit raised (damage).
            raise Fp8NewerFrameError(
                f"a version {version} frame, written by a newer release (this one reads version "
                f"{VERSION}); a miss here until stored again, kept for the servers that read it"
            )
        if magic != MAGIC:
            _refuse(f"not an fp8 frame (magic {bytes(magic)!r})")
        if version != VERSION:
            _refuse(_damaged_version(version))
        start = HEADER_SIZE + layout_len + 4 * scale_count
        if view.nbytes != start + payload_len:
            _refuse(f"frame is {view.nbytes} bytes, its header describes {start + payload_len}")
        if _digest(view) != checksum:
            _refuse("frame checksum mismatch")
        payload = view[start:]
        if fmt == PASSTHROUGH:
            if layout_len or scale_count:
                _refuse("passthrough frame with a layout or scales")
            self._count("decoded_objects")
            return payload
        layout, dtype = self._frame_layout(view, fmt, granularity, layout_len, scale_count, payload_len)
        if layout.nbytes != size:
            # Only the object's own L1 bytes are ever quantized, so a quantized frame decodes
            # to exactly its size: anything else is refused before the output is allocated.
            _refuse(f"frame layout {layout.format()} is {layout.nbytes} bytes, the object holds {size}")
        _check_record_layout(layout, record_layout)
        rows, channels = _rows(layout.shape)
        scales = torch.frombuffer(
            _writable(view[HEADER_SIZE + layout_len : start]), dtype=torch.float32, count=scale_count
        )
        output = bytearray(layout.nbytes)
        if scale_count == 1:
            _dequantize_by_table(payload, output, _FP8_DTYPES[fmt], scales, dtype)
        else:
            quantized = torch.frombuffer(_writable(payload), dtype=torch.uint8).view(_FP8_DTYPES[fmt])
            restored = torch.frombuffer(output, dtype=dtype).view(rows, channels)
            quantized = quantized.view(rows, channels)
            step = self._step(channels)
            for row in range(0, rows, step):
                restored[row : row + step].copy_(quantized[row : row + step].to(torch.float32).mul_(scales))
        self._count("decoded_objects")
        return memoryview(output)

    @staticmethod
    def _frame_layout(
        view: memoryview, fmt: int, granularity: int, layout_len: int, scale_count: int, payload_len: int
    ) -> tuple[TensorLayout, torch.dtype]:
        if fmt not in _FP8_DTYPES or granularity not in GRANULARITIES.values() or layout_len > _MAX_LAYOUT:
            _refuse(f"unknown format {fmt} / granularity {granularity} / layout length {layout_len}")
        try:
            layout = TensorLayout.parse(bytes(view[HEADER_SIZE : HEADER_SIZE + layout_len]).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            _refuse(f"frame layout is unreadable: {exc}")
        dtype = QUANTIZABLE.get(layout.dtype)
        expected_scales = _rows(layout.shape)[1] if granularity == GRANULARITIES["channel"] else 1
        if dtype is None or layout.numel != payload_len or scale_count != expected_scales or not payload_len:
            _refuse(
                f"frame layout {layout.format()} disagrees with {payload_len} values, {scale_count} scales"
            )
        return layout, dtype

    # -- counters ---------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _explain(self, reason: str, context: SerdeContext) -> None:
        # One INFO line per reason and serde instance says why objects go unquantized;
        # the counters keep the totals and DEBUG names every object.
        with self._lock:
            first = reason not in self._explained
            self._explained.add(reason)
        level = logging.INFO if first else logging.DEBUG
        log.log(level, "fp8: %s stored unquantized: %s (counted in %s)", context.key, _WHY[reason], reason)


_BITS: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _dequantize_by_table(
    payload: memoryview, output: bytearray, fp8: torch.dtype, scale: torch.Tensor, dtype: torch.dtype
) -> None:
    """One scale for the whole tensor: every fp8 byte maps to one output value, so a
    256-entry table of ``value * scale`` in the output dtype, gathered by numpy, gives the
    same numbers as converting and multiplying element by element, in one pass."""
    table = (torch.arange(256, dtype=torch.uint8).view(fp8).to(torch.float32) * scale).to(dtype)
    itemsize = table.element_size()
    bits = table.view(torch.uint8).numpy().view(_BITS[itemsize])
    np.take(bits, np.frombuffer(payload, dtype=np.uint8), out=np.frombuffer(output, dtype=_BITS[itemsize]))


def _check_record_layout(layout: TensorLayout, record_layout: str) -> None:
    """The loaded object gets the layout its record states, and a later fp8 stage (of
    another adapter) quantizes by it: values restored as the frame's dtype must not be
    labelled as another.  A record stating none (an in-memory store) leaves the frame's."""
    if record_layout and TensorLayout.parse_optional(record_layout) != layout:
        raise Fp8LayoutMismatchError(
            f"the record states layout {record_layout!r}, the frame was quantized as {layout.format()!r}"
        )


def _counter_of(refusal: Fp8FrameError) -> str:
    if isinstance(refusal, Fp8NewerFrameError):
        return "newer_frames"
    if isinstance(refusal, Fp8LayoutMismatchError):
        return "layout_mismatch"
    return "corrupt_frames"


def _damaged_version(version: int) -> str:
    if version > VERSION:
        return f"frame version {version} with a checksum mismatch: damaged, not a newer release's"
    return f"frame version {version} is not {VERSION}"


def _refuse(reason: str) -> NoReturn:
    raise Fp8FrameError(reason)
