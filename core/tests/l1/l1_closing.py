"""What the tests of an L1 closing under a copy share: an L1 of either backing, and a
close landing right after a copy's check passed (a stop between the check and the copy,
which runs without the L1 lock)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.l1 import L1Manager, L1Object

ALIGN = 4096


def memory_or_nvme_l1(request: pytest.FixtureRequest) -> Iterator[L1Manager]:
    """For a fixture parametrized with ``"memory"`` and ``"nvme"``: an L1 of that backing,
    closed after the test."""
    nvme_dir: Path | None = request.getfixturevalue("nvme_dir") if request.param == "nvme" else None
    manager = L1Manager(
        16 * ALIGN, align=ALIGN, prefault=False, nvme_path=None if nvme_dir is None else str(nvme_dir)
    )
    yield manager
    manager.close()


def closing_after_the_check(l1: L1Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    """Close ``l1`` right after a copy's check passed (a read's presence check, a write's
    reservation check: both are ``check_present``)."""
    table = l1._table
    check_present = table.check_present

    def check_then_close(obj: L1Object) -> None:
        check_present(obj)
        l1.close()

    monkeypatch.setattr(table, "check_present", check_then_close)
