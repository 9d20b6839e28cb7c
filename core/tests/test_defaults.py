"""The embedded default L2: where, how large, with eviction; the banner line; the claim."""

from __future__ import annotations

import io
import logging
import threading
from pathlib import Path

import pytest
from rich.console import Console

from lmcache_tiers import defaults
from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.files.dirlock import LOCK_DIR_ENV
from lmcache_tiers.l2.scan_progress import watch_scans
from lmcache_tiers.plugins import load_registry


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(defaults.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    monkeypatch.delenv(defaults.CACHE_GB_ENV, raising=False)
    return tmp_path / "cache"


def test_default_is_a_capped_fs_with_lru_eviction(cache: Path) -> None:
    if "fs" not in load_registry().names(defaults.Kind.L2_ADAPTER):
        pytest.skip("lmcache-plugin-fs is not installed")
    (adapter,) = defaults.default_l2_adapters(load_registry())
    assert adapter["type"] == "fs" and adapter["path"] == str(cache / "l2")
    assert 0 < adapter["max_capacity_gb"] <= defaults.DEFAULT_L2_CAPACITY_GB
    assert adapter["eviction"] == {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}
    assert adapter["use_odirect"] == "auto", "O_DIRECT where the filesystem takes it"
    note = defaults.describe_default(adapter)
    assert note is not None and "LRU eviction at 80% frees 20%" in note
    assert defaults.CACHE_DIR_ENV in note and "--no-default-l2" in note
    assert defaults.describe_default({**adapter, "path": "/elsewhere"}) is None


def test_capacity_is_ten_gib_or_a_tenth_of_the_filesystem(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(defaults, "_filesystem_size", lambda _d: 20 << 30)
    assert defaults.default_capacity_gb()[0] == 2.0
    monkeypatch.setattr(defaults, "_filesystem_size", lambda _d: 1 << 40)
    assert defaults.default_capacity_gb()[0] == 10.0
    monkeypatch.setenv(defaults.CACHE_GB_ENV, "0.5")
    assert defaults.default_capacity_gb() == (0.5, f"set by {defaults.CACHE_GB_ENV}")
    for wrong in ("lots", "nan", "inf", "-1", "1e300"):  # 1e300: beyond any size field
        monkeypatch.setenv(defaults.CACHE_GB_ENV, wrong)
        with pytest.raises(ConfigError, match=defaults.CACHE_GB_ENV):
            defaults.default_capacity_gb()


def test_a_small_filesystem_gives_a_small_capacity_never_zero(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0 GiB is "no capacity" to the adapter, and eviction without one is refused: the
    # operator, who set neither, would be told to set max_capacity_gb.
    monkeypatch.setattr(defaults, "_filesystem_size", lambda _d: 1 << 20)
    assert defaults.default_capacity_gb()[0] == pytest.approx((1 << 20) * 0.1 / (1 << 30))
    if "fs" not in load_registry().names(defaults.Kind.L2_ADAPTER):
        pytest.skip("lmcache-plugin-fs is not installed")
    (adapter,) = defaults.default_l2_adapters(load_registry())
    decode_adapter(load_registry(), adapter, 0)  # raised "eviction needs a capacity"


def test_a_second_default_claim_gets_a_hint(cache: Path) -> None:
    claim = defaults.claim_default_l2()
    with pytest.raises(ConfigError) as info:
        defaults.claim_default_l2()
    message = str(info.value)
    assert defaults.CACHE_DIR_ENV in message and "--no-default-l2" in message and ".lock" not in message
    claim.release()  # type: ignore[attr-defined]
    defaults.claim_default_l2().release()  # type: ignore[attr-defined]


class _Scanning:
    """An adapter whose start-up scan runs until ``done`` is set."""

    name = "0:slow"

    def __init__(self) -> None:
        self.done = threading.Event()
        self.keys = 0

    def stats(self) -> dict[str, int]:
        self.keys += 1000
        return {
            "scan_running": int(not self.done.is_set()),
            "scan_keys": self.keys,
            "scan_bytes": self.keys << 20,
        }


@pytest.mark.parametrize("terminal", [False, True])
def test_a_long_scan_shows_progress(terminal: bool, caplog: pytest.LogCaptureFixture) -> None:
    adapter = _Scanning()
    output = io.StringIO()
    console = Console(file=output, force_terminal=terminal, width=120)
    with caplog.at_level(logging.INFO, logger="lmcache_tiers.l2"):
        thread = watch_scans([adapter], console, poll_s=0.05)  # type: ignore[list-item]
        threading.Timer(1.5, adapter.done.set).start()
        thread.join(10)
    assert not thread.is_alive()
    if terminal:
        assert "0:slow: start-up scan" in output.getvalue() and "objects/s" in output.getvalue()
    else:
        assert any("start-up scan:" in r.getMessage() and "objects" in r.getMessage() for r in caplog.records)


def test_a_quick_scan_shows_nothing() -> None:
    adapter = _Scanning()
    adapter.done.set()
    output = io.StringIO()
    thread = watch_scans([adapter], Console(file=output, force_terminal=True), poll_s=0.05)  # type: ignore[list-item]
    thread.join(10)
    assert output.getvalue() == ""
