"""The figures docs/serde.md gives for fp8's error bound are the ones the codec meets."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from lmcache_plugin_serde_fp8 import Fp8Config
from lmcache_plugin_serde_fp8.codec import Fp8Serde

from lmcache_tiers.plugin import SerdeContext
from lmcache_tiers.testing.serde import suite_key

DOC = Path(__file__).resolve().parents[3] / "docs" / "serde.md"
FLOAT16_SMALLEST_NORMAL = 2.0**-14


def _doc() -> str:
    return " ".join(DOC.read_text().split())


def test_the_relative_bounds_quoted_for_bf16_are_the_formula_rounded() -> None:
    u = 2.0**-8  # bf16's unit roundoff
    for fmt, relative in (("e4m3fn", 2.0**-4), ("e5m2", 2.0**-3)):
        row = re.search(rf"\| {fmt} \(\d mantissa bits\) \|.*?\(([\d.]+)% for bf16\)", _doc())
        assert row is not None, f"no bf16 figure for {fmt}"
        assert float(row.group(1)) == round(100 * (relative + u + relative * u), 1), fmt


def _restored_float16_subnormals(amax: float) -> int:
    """How many float16 values below its smallest normal come back nonzero but still below
    it (rounded to float16's fixed subnormal step) from an e4m3fn tensor of this amax."""
    values = torch.cat([torch.tensor([amax]), torch.arange(1, 1024, dtype=torch.float64) * 2.0**-24]).to(
        torch.float16
    )
    data = values.view(torch.uint8).numpy().tobytes()
    layout = f"float16[{values.numel()}]"
    serde = Fp8Serde(Fp8Config(format="e4m3fn"))
    frame = bytes(serde.encode(memoryview(data), SerdeContext(suite_key(), len(data), layout)))
    assert serde.stats()["quantized_objects"] == 1
    decoded = serde.decode(memoryview(frame), SerdeContext(suite_key(), len(data), record_layout=layout))
    restored = torch.frombuffer(bytearray(bytes(decoded)), dtype=torch.float16)[1:].double().abs()
    return int(((restored > 0) & (restored < FLOAT16_SMALLEST_NORMAL)).sum())


def test_the_float16_amax_below_which_e4m3fn_restores_into_subnormals() -> None:
    """fp8's smallest step is scale * 2^-9 = amax / 448 * 2^-9: below float16's smallest
    normal exactly when amax < 448 * 2^-5 = 14, the threshold the doc must quote."""
    quoted = re.search(r"with e4m3fn, in a tensor or channel whose amax is below ([\d.]+)", _doc())
    assert quoted is not None
    threshold = float(quoted.group(1))
    assert _restored_float16_subnormals(0.9 * threshold) > 0
    assert _restored_float16_subnormals(2 * threshold) == 0
