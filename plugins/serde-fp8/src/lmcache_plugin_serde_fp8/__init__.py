"""Serde ``fp8``: scaled fp8 quantization of floating-point KV tensors."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl

# The manifest imports only core's light modules; torch is imported by the codec module,
# only when an adapter is configured with this serde.

#: LMCache's ``fp8_dtype`` spelling -> ``format``
_REFERENCE_DTYPES = {"float8_e4m3fn": "e4m3fn", "float8_e5m2": "e5m2"}


class Fp8Config(ComponentConfig):
    """Quantize each floating-point tensor to fp8 with a scale and dequantize it to its
    original dtype on load: half the bytes of bf16, a quarter of float32.

    The scale maps the largest magnitude (of the tensor, or of each channel = last
    dimension) onto fp8's largest finite value.  Error bound, per element: at most
    2^-4 (e4m3fn) or 2^-3 (e5m2) of its magnitude, plus the rounding to the original dtype,
    for magnitudes in fp8's normal range (>= scale * 2^-6 for e4m3fn, 2^-14 for e5m2);
    smaller ones are off by at most scale * 2^-10 (e4m3fn) or scale * 2^-17 (e5m2).
    Objects without a tensor layout, of an integer dtype, holding inf or nan, or that
    would not shrink are stored unchanged and counted.  ``fp8_dtype`` is LMCache's
    spelling of ``format`` and is accepted in its place.
    """

    #: LMCache's fp8 fields without an equivalent here -> why (null is accepted)
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        "max_workers": "fp8 has no threads of its own: it quantizes on the adapter's worker "
        "threads (num_workers, where the adapter has it)",
    }

    format: Annotated[
        Literal["e4m3fn", "e5m2"] | None,
        msgspec.Meta(description="fp8 format: e4m3fn (more precision) or e5m2 (more range); null = e4m3fn."),
    ] = None
    granularity: Annotated[
        Literal["tensor", "channel"],
        msgspec.Meta(description="One scale per tensor, or one per channel (the last dimension)."),
    ] = "tensor"
    fp8_dtype: Annotated[
        Literal["float8_e4m3fn", "float8_e5m2"] | None,
        msgspec.Meta(description="LMCache's name for format (torch dtype name); read into format."),
    ] = None

    def __post_init__(self) -> None:
        from_reference = _REFERENCE_DTYPES[self.fp8_dtype] if self.fp8_dtype is not None else None
        if self.format is not None and from_reference is not None and self.format != from_reference:
            raise ValueError(f"format {self.format!r} contradicts fp8_dtype {self.fp8_dtype!r}")
        # One spelling in the resolved config, so a printed config reads back the same.
        msgspec.structs.force_setattr(self, "format", self.format or from_reference or "e4m3fn")
        msgspec.structs.force_setattr(self, "fp8_dtype", None)


@hookimpl
def tiers_register_serdes(registry: KindRegistry) -> None:
    registry.add(
        "fp8",
        "lmcache_plugin_serde_fp8.codec:Fp8Serde",
        Fp8Config,
        install_hint="pip install lmcache-plugin-serde-fp8 -c constraints.txt (needs torch)",
    )
