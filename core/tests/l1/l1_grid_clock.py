"""What the tests of read-lock deadlines on the lock grid share: a clock set by the test."""

from __future__ import annotations

import math
import time
import types

import pytest


def grid_clock(monkeypatch: pytest.MonkeyPatch, step: float, *modules: types.ModuleType) -> list[float]:
    """The clock ``modules`` read (``now[0]``, set by the test), starting at a grid point
    of ``step`` (a power of two): a lock taken then expires exactly its TTL later, one
    taken any later in the next cell.

    At a power of two past the real clock, so that the times the tests take and their
    deadlines share one binary exponent: a time one ulp past a cell's edge plus the TTL
    rounds down onto the edge's deadline when the sum crosses a power of two (as it did
    from a start in [448, 512)), and a lock meant for the next cell joined the last."""
    now = [2.0 ** max(8, math.ceil(math.log2(time.monotonic() + step)))]
    clock = types.SimpleNamespace(monotonic=lambda: now[0])
    for module in modules:
        monkeypatch.setattr(module, "time", clock)
    return now
