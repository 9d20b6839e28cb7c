"""Benchmark cases given as ``COUNTxMIB,...`` (``256x1,64x16``): how many objects of how
many MiB each, shared by the benchmarks that move batches of equal-sized objects."""

from __future__ import annotations

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


def parse_cases(text: str) -> list[Case]:
    """``"256x1,64x16"`` -> 256 objects of 1 MiB, 64 of 16 MiB."""
    cases = []
    for item in text.split(","):
        count, size_mib = item.lower().split("x")
        cases.append(Case(int(count), int(size_mib) * MIB))
    return cases
