"""Capacities given as block counts or byte sizes, and the L1 geometry behind them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from lmcache_tiers.errors import ConfigError

_SPEC = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
#: the largest capacity accepted, in blocks and in bytes: beyond them no machine holds it,
#: and the simulator's arithmetic (and a JSON reader) no longer counts blocks exactly
MAX_BLOCKS = 2**53
MAX_BYTES = 2**53
#: digits a capacity may have: Python refuses to read integers of more than 4300
_MAX_DIGITS = 64
#: suffixes of a block count (decimal: 4k = 4000 blocks)
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
#: suffixes of a byte size
_BYTE_SUFFIXES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


@dataclass(frozen=True)
class Capacity:
    """A capacity as the user wrote it: a number of blocks or a number of bytes."""

    text: str
    blocks: int | None = None
    bytes: int | None = None

    def in_blocks(self, extent_bytes: int) -> int:
        """Blocks that fit, each taking ``extent_bytes`` (its aligned L1 extent)."""
        if self.blocks is not None:
            return self.blocks
        assert self.bytes is not None
        return self.bytes // extent_bytes


def parse_capacity(text: str) -> Capacity:
    """``1000``, ``4k`` (blocks) or ``512MiB``, ``2GB`` (bytes); ConfigError otherwise."""
    match = _SPEC.match(text)
    if match is None:
        raise ConfigError(f"bad capacity {text!r}: give a block count (1000, 4k) or a size (512MiB, 2GB)")
    if len(match.group(1)) > _MAX_DIGITS:
        raise ConfigError(f"bad capacity {text.strip()[:40]!r}...: more than {_MAX_DIGITS} digits")
    number, suffix = Fraction(match.group(1)), match.group(2).lower()
    if suffix in _COUNT_SUFFIXES:
        count = number * _COUNT_SUFFIXES[suffix]
        if count.denominator != 1:
            raise ConfigError(
                f"bad capacity {text!r}: {float(count):g} blocks is not a whole number of blocks; "
                "give a whole count or a size (512MiB)"
            )
        blocks = int(count)
        if blocks < 1:
            raise ConfigError(f"bad capacity {text!r}: at least one block is needed")
        if blocks > MAX_BLOCKS:
            raise ConfigError(f"bad capacity {text!r}: more than 2**53 blocks, which no machine holds")
        return Capacity(text.strip(), blocks=blocks)
    if suffix in _BYTE_SUFFIXES:
        size = int(number * _BYTE_SUFFIXES[suffix])
        if size < 1:
            raise ConfigError(f"bad capacity {text!r}: the size must be positive")
        if size > MAX_BYTES:
            raise ConfigError(f"bad capacity {text!r}: more than 2**53 bytes (8 PiB), which no machine holds")
        return Capacity(text.strip(), bytes=size)
    raise ConfigError(
        f"bad capacity {text!r}: unknown unit {match.group(2)!r} "
        "(blocks: k, m; bytes: B, KB, MB, GB, KiB, MiB, GiB)"
    )


def extent_bytes(block_bytes: int, align: int) -> int:
    """L1 bytes one block takes: its size rounded up to the allocator alignment."""
    return max(1, -(-block_bytes // align)) * align


def l1_size_for_blocks(blocks: int, block_bytes: int, align: int = 4096) -> tuple[float, int]:
    """``(l1_size_gb, l1_align_bytes)`` for an L1 that holds exactly ``blocks`` blocks and
    is never 100% full, so a trigger watermark of 1.0 never starts background eviction.

    The arena gets one alignment unit more than the blocks need, which no block fits in;
    with blocks no larger than the alignment, the alignment is lowered so a block spans
    two units.  The size is a multiple of a power of two, so the GiB float is exact.
    """
    if blocks < 1:
        raise ConfigError("an L1 must hold at least one block")
    if block_bytes < 128:
        raise ConfigError(f"blocks of {block_bytes} bytes are too small to replay (at least 128)")
    while extent_bytes(block_bytes, align) == align and align > 64:
        align //= 2
    size = blocks * extent_bytes(block_bytes, align) + align
    if size > MAX_BYTES:
        # Refused here, not by an OverflowError converting it to GiB below.
        raise ConfigError(
            f"an L1 of {blocks} blocks of {block_bytes} bytes would take more than 2**53 bytes "
            "(8 PiB), which no machine holds"
        )
    return size / (1 << 30), align
