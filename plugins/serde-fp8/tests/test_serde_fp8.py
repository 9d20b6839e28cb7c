"""The fp8 serde: the conformance suite, the error bound, the size ratio and passthrough."""

from __future__ import annotations

import logging
import struct

import msgspec
import numpy as np
import pytest
import torch
from lmcache_plugin_serde_fp8 import Fp8Config
from lmcache_plugin_serde_fp8.codec import HEADER_SIZE, Fp8FrameError, Fp8Serde

from lmcache_tiers.plugin import SerdeContext
from lmcache_tiers.testing.serde import (
    DETECTS_CORRUPTION,
    KV_SHAPE,
    SerdeSuite,
    kv_layout,
    kv_like_bf16,
    kv_like_float32,
    suite_key,
)

#: (relative bound in fp8's normal range, smallest normal, absolute bound below it / scale)
BOUNDS = {"e4m3fn": (2.0**-4, 2.0**-6, 2.0**-10), "e5m2": (2.0**-3, 2.0**-14, 2.0**-17)}
#: unit roundoff of the dtype the values are restored to
ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-24}
#: (smallest normal, half the spacing of the subnormals) of that dtype, float32's for float64
#: (its values are scaled in float32): a value restored below the smallest normal is rounded
#: by up to that half spacing, not by u
SUBNORMALS = {
    "bfloat16": (2.0**-126, 2.0**-134),
    "float16": (2.0**-14, 2.0**-25),
    "float32": (2.0**-126, 2.0**-150),
    "float64": (2.0**-126, 2.0**-150),
}
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}
#: a realistic chunk: 8 layers of 256 tokens, 8 KV heads of 128 (8 MiB of bf16)
REALISTIC_SHAPE = (2, 8, 256, 1024)


#: elements of the bound's check at a time: its float64 temporaries stay in the cache,
#: where the whole of a large object's would be a dozen arrays of hundreds of MiB
CHECK_CHUNK_ELEMENTS = 1 << 16
#: how numpy holds each dtype's elements: bfloat16, which it lacks, as its bits
STORED_AS = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "float64": np.float64}


def stored(data: bytes, dtype: str) -> np.ndarray:
    return np.frombuffer(data, dtype=STORED_AS[dtype])


def exact_float64(elements: np.ndarray) -> np.ndarray:
    """Elements :func:`stored` returned, exactly in float64.  A bfloat16 is the top half
    of a float32; numpy converts, as torch's bfloat16 conversion is slow on small slices."""
    if elements.dtype == np.uint16:
        return (elements.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return elements.astype(np.float64)


def as_float64(data: bytes, dtype: str) -> np.ndarray:
    return exact_float64(stored(data, dtype))


def check_bound(original: bytes, decoded: bytes, layout: str, fmt: str, granularity: str) -> dict[str, float]:
    """Assert the documented per-element bound, on every element; return the measured
    errors.  Checked a slice of rows at a time: whole float64 copies of a large object
    and their temporaries made this check the slowest part of these tests."""
    dtype = layout.split("[")[0]
    shape = tuple(int(d) for d in layout.split("[")[1].rstrip("]").split(","))
    x_all = stored(original, dtype).reshape(-1, shape[-1])
    y_all = stored(decoded, dtype).reshape(-1, shape[-1])
    rows = max(1, CHECK_CHUNK_ELEMENTS // x_all.shape[1])
    slices = [slice(start, start + rows) for start in range(0, x_all.shape[0], rows)]
    channel_maxima = np.max([np.abs(exact_float64(x_all[part])).max(axis=0) for part in slices], axis=0)
    amax = channel_maxima if granularity == "channel" else channel_maxima.max()
    relative, smallest_normal, absolute = BOUNDS[fmt]
    scale = np.where(amax > 0, amax, 1.0) / float(
        torch.finfo(torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2).max
    )
    u = ROUNDOFF[dtype]
    smallest_restored_normal, subnormal_rounding = SUBNORMALS[dtype]
    worst = -np.inf
    normal_maxima: list[float] = []
    relative_sum, nonzero_count, error_squares, value_squares = 0.0, 0, 0.0, 0.0
    for part in slices:
        x = exact_float64(x_all[part])
        y = exact_float64(y_all[part])
        error = np.abs(y - x)
        normal = np.abs(x) >= scale * smallest_normal
        allowed = np.where(
            normal, (relative + u + relative * u) * np.abs(x), (absolute * scale) * (1 + u) + u * np.abs(x)
        ) + np.where(np.abs(y) < smallest_restored_normal, subnormal_rounding, 0.0)
        worst = max(worst, float((error - allowed * (1 + 1e-6)).max()))
        if normal.any():
            normal_maxima.append(float((error[normal] / np.abs(x[normal])).max()))
        nonzero = x != 0
        relative_sum += float((error[nonzero] / np.abs(x[nonzero])).sum())
        nonzero_count += int(nonzero.sum())
        error_squares += float((error**2).sum())
        value_squares += float((x**2).sum())
    assert worst <= 0, f"{fmt}/{granularity}: an element exceeds the bound by {worst}"
    return {
        "max_relative_normal": max(normal_maxima),
        "mean_relative": relative_sum / nonzero_count,
        "relative_rms": float(np.sqrt(error_squares / value_squares)),
    }


class _Fp8Suite(SerdeSuite):
    component_name = "fp8"
    capabilities = frozenset({DETECTS_CORRUPTION})
    config = Fp8Config()

    def make_config(self) -> Fp8Config:
        return self.config

    def assert_round_trip(self, original: bytes, decoded: bytes, layout: str) -> None:
        assert len(decoded) == len(original)
        dtype = layout.split("[")[0]
        finite = dtype in TORCH_DTYPES and bool(np.isfinite(as_float64(original, dtype)).all())
        if not finite or decoded == original:
            assert decoded == original, f"an object fp8 cannot quantize ({layout!r}) must come back unchanged"
            return
        check_bound(original, decoded, layout, self.config.format or "e4m3fn", self.config.granularity)


class TestFp8TensorE4m3(_Fp8Suite):
    config = Fp8Config()


class TestFp8ChannelE4m3(_Fp8Suite):
    config = Fp8Config(format="e4m3fn", granularity="channel")


class TestFp8ChannelE5m2(_Fp8Suite):
    config = Fp8Config(format="e5m2", granularity="channel")


def _encode(serde: Fp8Serde, data: bytes, layout: str) -> bytes:
    return bytes(serde.encode(memoryview(data), SerdeContext(suite_key(), len(data), layout)))


def _decode(serde: Fp8Serde, frame: bytes, size: int) -> bytes:
    return bytes(serde.decode(memoryview(frame), SerdeContext(suite_key(), size)))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_error_bound_and_size_ratio_on_realistic_bf16_kv(fmt: str, granularity: str) -> None:
    data = kv_like_bf16(REALISTIC_SHAPE, seed=21)
    layout = kv_layout(REALISTIC_SHAPE)
    serde = Fp8Serde(Fp8Config(format=fmt, granularity=granularity))  # type: ignore[arg-type]
    frame = _encode(serde, data, layout)
    errors = check_bound(data, _decode(serde, frame, len(data)), layout, fmt, granularity)
    ratio = len(frame) / len(data)
    print(
        f"fp8 {fmt}/{granularity}: ratio {ratio:.4f}, " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items())
    )
    assert 0.5 < ratio < 0.5 + (HEADER_SIZE + 64 + 4 * 1024) / len(data)
    relative = BOUNDS[fmt][0]
    assert errors["max_relative_normal"] <= relative + 2.0**-8 + relative * 2.0**-8
    # Round to nearest spreads errors over the whole half-ulp: the mean sits well below the bound.
    assert errors["mean_relative"] < 0.6 * relative
    assert errors["relative_rms"] < 0.6 * relative


def test_channel_scales_help_tensors_with_outlier_channels() -> None:
    values = kv_like_float32(REALISTIC_SHAPE, seed=22)
    values[..., :4] *= 300.0  # a few channels far larger than the rest
    data = values.astype(np.float32).tobytes()
    layout = kv_layout(REALISTIC_SHAPE, "float32")
    measured = {}
    for granularity in ("tensor", "channel"):
        serde = Fp8Serde(Fp8Config(granularity=granularity))  # type: ignore[arg-type]
        frame = _encode(serde, data, layout)
        assert len(frame) < 0.26 * len(data)  # float32 -> one byte per element
        measured[granularity] = check_bound(
            data, _decode(serde, frame, len(data)), layout, "e4m3fn", granularity
        )
    assert measured["channel"]["mean_relative"] < measured["tensor"]["mean_relative"]


def test_dtype_and_shape_travel_in_the_frame() -> None:
    for dtype in ("bfloat16", "float16", "float32", "float64"):
        values = torch.randn(3, 5, 7, dtype=torch.float64).to(TORCH_DTYPES[dtype])
        data = values.view(torch.uint8).numpy().tobytes()
        layout = kv_layout((3, 5, 7), dtype)
        frame = _encode(Fp8Serde(), data, layout)
        assert frame[HEADER_SIZE : HEADER_SIZE + len(layout)] == layout.encode()
        decoded = _decode(Fp8Serde(), frame, len(data))  # another instance: nothing kept in memory
        restored = torch.frombuffer(bytearray(decoded), dtype=TORCH_DTYPES[dtype]).view(3, 5, 7)
        torch.testing.assert_close(restored.double(), values.double(), rtol=0.07, atol=0.02)


@pytest.mark.parametrize(
    ("data", "layout", "counter"),
    [
        (kv_like_bf16(), "", "passthrough_no_layout"),
        (kv_like_bf16()[:-2], kv_layout(KV_SHAPE), "passthrough_layout_mismatch"),
        (bytes(range(256)) * 16, "int32[1024]", "passthrough_not_float"),
        (bytes(64), "float8_e4m3fn[64]", "passthrough_not_float"),
        (b"", "bfloat16[0,16]", "passthrough_empty"),
        (np.array([1.0, np.inf] * 64, np.float32).tobytes(), "float32[4,32]", "passthrough_non_finite"),
        (np.array([1.0, np.nan] * 64, np.float32).tobytes(), "float32[2,64]", "passthrough_non_finite"),
        (np.array([1.0, 1e300] * 64).tobytes(), "float64[128]", "passthrough_non_finite"),
        (np.ones((2, 1), np.float16).tobytes(), "float16[2,1]", "passthrough_not_smaller"),
    ],
    ids=["no-layout", "mismatch", "int", "fp8", "empty", "inf", "nan", "huge", "tiny"],
)
def test_passthrough_is_exact_counted_and_explained(
    data: bytes, layout: str, counter: str, caplog: pytest.LogCaptureFixture
) -> None:
    serde = Fp8Serde(Fp8Config(granularity="channel"))
    with caplog.at_level(logging.INFO, "lmcache_tiers.serde.fp8"):
        frame = _encode(serde, data, layout)
        _encode(serde, data, layout)
    assert len(frame) == HEADER_SIZE + len(data)
    assert _decode(serde, frame, len(data)) == data
    stats = serde.stats()
    assert stats[counter] == 2 and stats["quantized_objects"] == 0
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # one line per reason, then DEBUG
    assert counter in caplog.text


def test_zeros_and_tiny_magnitudes_quantize_without_overflow() -> None:
    serde = Fp8Serde()
    zeros = bytes(4096)
    assert _decode(serde, _encode(serde, zeros, "float32[1024]"), 4096) == zeros
    tiny = np.full(1024, 1e-40, np.float32).tobytes()  # subnormal float32
    decoded = np.frombuffer(_decode(serde, _encode(serde, tiny, "float32[1024]"), 4096), np.float32)
    # The scale never drops below float32's smallest normal; error stays within scale * 2^-10.
    smallest_scale = float(np.finfo(np.float32).tiny)
    assert np.isfinite(decoded).all() and np.abs(decoded - 1e-40).max() <= smallest_scale * 2.0**-10
    assert serde.stats()["quantized_objects"] == 2


def test_reference_spelling_and_resolved_config() -> None:
    assert msgspec.convert({"fp8_dtype": "float8_e5m2"}, Fp8Config).format == "e5m2"
    assert msgspec.convert({}, Fp8Config).format == "e4m3fn"
    assert msgspec.to_builtins(msgspec.convert({"fp8_dtype": "float8_e4m3fn"}, Fp8Config)) == {
        "format": "e4m3fn",
        "granularity": "tensor",
        "fp8_dtype": None,
    }
    with pytest.raises(msgspec.ValidationError, match="contradicts"):
        msgspec.convert({"fp8_dtype": "float8_e4m3fn", "format": "e5m2"}, Fp8Config)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"fp8_dtype": "float8_e4m3fnuz"}, Fp8Config)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"granularity": "row"}, Fp8Config)


def test_forged_frames_are_refused_before_allocation() -> None:
    """A frame whose checksum is valid but whose layout claims other sizes is refused."""
    import xxhash

    serde = Fp8Serde()
    layout = b"bfloat16[65536,65536]"
    body = layout + struct.pack("<f", 1.0) + bytes(16)
    head = struct.pack("<4sBBBBHHIQ", b"LTF8", 1, 1, 1, 0, len(layout), 0, 1, 16)
    digest = xxhash.xxh3_64(head + body).intdigest()
    with pytest.raises(Fp8FrameError, match="disagrees"):
        serde.decode(memoryview(head + struct.pack("<Q", digest) + body), SerdeContext(suite_key(), 32))
    assert serde.stats()["corrupt_frames"] == 1


def test_a_frame_that_decodes_to_another_size_than_the_object_is_refused_before_allocation() -> None:
    """A checksummed frame whose layout is larger than the object (float64 values for a bf16
    object: 4x the bytes) is refused before its output is allocated, and counted."""
    import xxhash

    serde = Fp8Serde()
    layout = b"float64[4096]"
    body = layout + struct.pack("<f", 1.0) + bytes(4096)
    head = struct.pack("<4sBBBBHHIQ", b"LTF8", 1, 1, 1, 0, len(layout), 0, 1, 4096)
    frame = head + struct.pack("<Q", xxhash.xxh3_64(head + body).intdigest()) + body
    with pytest.raises(Fp8FrameError, match="the object holds 8192"):
        serde.decode(memoryview(frame), SerdeContext(suite_key(), 8192))
    assert serde.stats()["corrupt_frames"] == 1
    # The same frame decodes for an object of its size.
    assert len(_decode(serde, frame, 8 * 4096)) == 8 * 4096


def test_bytes_of_another_size_than_the_object_are_never_quantized() -> None:
    """A layout only describes the object's L1 bytes: input of its layout's size that is not
    the object (an earlier serde's output, here 60 bytes longer than the object) is stored
    unquantized, so the frame decodes bit for bit."""
    data = kv_like_bf16(seed=23)
    serde = Fp8Serde()
    context = SerdeContext(suite_key(), len(data) - 60, kv_layout(KV_SHAPE))
    frame = bytes(serde.encode(memoryview(data), context))
    assert len(frame) == HEADER_SIZE + len(data)
    assert serde.stats()["passthrough_layout_mismatch"] == 1 and serde.stats()["quantized_objects"] == 0
    assert _decode(serde, frame, len(data) - 60) == data


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_encoding_leaves_a_writable_object_unchanged(dtype: str, granularity: str) -> None:
    """The adapter hands fp8 a writable view of the L1 object, which other readers are
    served from: quantizing it must read those bytes, never scale them in place."""
    values = torch.randn(64, 128, dtype=torch.float64).to(TORCH_DTYPES[dtype])
    l1 = bytearray(values.view(torch.uint8).numpy().tobytes())
    before = bytes(l1)
    serde = Fp8Serde(Fp8Config(granularity=granularity))  # type: ignore[arg-type]
    frame = bytes(serde.encode(memoryview(l1), SerdeContext(suite_key(), len(l1), f"{dtype}[64,128]")))
    assert serde.stats()["quantized_objects"] == 1
    assert bytes(l1) == before
    check_bound(before, _decode(serde, frame, len(l1)), f"{dtype}[64,128]", "e4m3fn", granularity)


def test_a_frame_of_another_layout_than_its_record_states_is_refused() -> None:
    """The loaded object gets the layout its record states (a later fp8 stage of another
    adapter quantizes by it): a quantized frame of bf16 values whose record states float16
    of the same size (two overlapping stores of one key with different layouts, or a
    rewritten header) would hand L1 bf16 bytes labelled float16.  It is refused, counted;
    the same frame decodes where the record states its layout, or none."""
    values = torch.randn(4, 64, dtype=torch.bfloat16)
    data = values.view(torch.uint8).numpy().tobytes()
    serde = Fp8Serde()
    stated = "bfloat16[4,64]"
    frame = bytes(serde.encode(memoryview(data), SerdeContext(suite_key(), len(data), stated, stated)))
    assert serde.stats()["quantized_objects"] == 1
    other = SerdeContext(suite_key(), len(data), record_layout="float16[4,64]")
    with pytest.raises(Fp8FrameError, match="float16"):
        serde.decode(memoryview(frame), other)
    assert serde.stats()["layout_mismatch"] == 1 and serde.stats()["decoded_objects"] == 0
    for record_layout in (stated, ""):
        context = SerdeContext(suite_key(), len(data), record_layout=record_layout)
        assert len(serde.decode(memoryview(frame), context)) == len(data)
    assert serde.stats()["decoded_objects"] == 2


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_float16_values_in_its_subnormal_range_meet_the_documented_bound(fmt: str) -> None:
    """float16's subnormals (below 2^-14) are spaced 2^-24 apart: a value restored there is
    rounded by up to 2^-25 whatever its size, so the smallest (a few multiples of 2^-24) are
    off by a large fraction of themselves beyond fp8's relative error.  The bound states it."""
    values = torch.randn(64, 128, generator=torch.Generator().manual_seed(24)) * 3e-7
    data = values.to(torch.float16).view(torch.uint8).numpy().tobytes()
    layout = "float16[64,128]"
    serde = Fp8Serde(Fp8Config(format=fmt))  # type: ignore[arg-type]
    frame = _encode(serde, data, layout)
    assert serde.stats()["quantized_objects"] == 1
    check_bound(data, _decode(serde, frame, len(data)), layout, fmt, "tensor")
