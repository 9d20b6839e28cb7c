"""Benchmark cases given as ``COUNTxMIB,...`` (``256x1,64x16``): how many objects of how
many MiB each, shared by the benchmarks that move batches of equal-sized objects."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    """``count`` objects of ``size`` bytes each."""

    count: int
    size: int

    @property
    def total(self) -> int:
        return self.count * self.size

    @property
    def label(self) -> str:
        return f"{self.count} x {self.size // MIB} MiB"

    @property
    def tag(self) -> str:
        """The case as it was given (``256x1``)."""
        return f"{self.count}x{self.size // MIB}"


def count_by_size(item: str, *, noun: str, form: str, unit: str, example: str) -> tuple[int, int]:
    """``"256x1"`` -> (256, 1): a count and a size, both whole numbers >= 1.  A malformed
    item raises ``argparse.ArgumentTypeError`` naming it (one ``error:`` line from argparse)."""
    parts = item.lower().split("x")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{noun} {item!r} is not {form} (e.g. {example})")
    count, size = (int(part) for part in parts)
    if count < 1 or size < 1:
        raise argparse.ArgumentTypeError(f"{noun} {item!r}: count and {unit} must both be >= 1")
    return count, size


def parse_cases(text: str) -> list[Case]:
    """``"256x1,64x16"`` -> 256 objects of 1 MiB, 64 of 16 MiB.  Usable as an argparse
    ``type``: a malformed case is one ``error:`` line naming it, not a traceback."""
    cases = []
    for item in text.split(","):
        count, size_mib = count_by_size(item, noun="case", form="COUNTxMIB", unit="MiB", example="256x1")
        cases.append(Case(count, size_mib * MIB))
    return cases


def check_whole(call: str, index: int, moved: int, size: int) -> None:
    """A baseline write or read that moved fewer bytes than the object's is a failed
    baseline, not a fast one: the run stops, naming the call and the byte counts (unlike
    an ``assert``, this check stays under ``python -O``)."""
    if moved != size:
        raise SystemExit(f"{call} of object {index} moved {moved} of {size} bytes")
