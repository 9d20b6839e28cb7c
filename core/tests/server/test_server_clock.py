"""The server's uptime is a duration: a step of the wall clock (NTP, a VM resumed) while
it serves changes neither /status nor the stop summary."""

from __future__ import annotations

import time
import types
import uuid
from collections.abc import Callable

import pytest

from lmcache_tiers.config import ServerConfig
from lmcache_tiers.server import app
from lmcache_tiers.server.app import TiersServer

HOUR_S = 3600.0


def _wall_clock_stepped(monkeypatch: pytest.MonkeyPatch, step_s: float) -> None:
    """From now on the server module reads a wall clock ``step_s`` off the real one (the
    monotonic clock, which no step moves, is left alone)."""
    real_time: Callable[[], float] = time.time
    stepped = types.SimpleNamespace(
        **{name: getattr(time, name) for name in dir(time) if not name.startswith("__")}
    )
    stepped.time = lambda: real_time() + step_s
    monkeypatch.setattr(app, "time", stepped)


@pytest.mark.parametrize("step_s", [-HOUR_S, HOUR_S])
def test_a_wall_clock_step_leaves_the_uptime_in_status_alone(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch, step_s: float
) -> None:
    _wall_clock_stepped(monkeypatch, step_s)
    uptime = server.status()["server"]["uptime_s"]
    assert 0.0 <= uptime < HOUR_S, uptime


@pytest.mark.parametrize("step_s", [-HOUR_S, HOUR_S])
def test_a_wall_clock_step_leaves_the_uptime_in_the_stop_summary_alone(
    monkeypatch: pytest.MonkeyPatch, step_s: float
) -> None:
    config = ServerConfig(
        port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=f"tiers_unit_{uuid.uuid4().hex[:12]}"
    )
    server = TiersServer(config)
    _wall_clock_stepped(monkeypatch, step_s)
    summary = server.close()
    assert 0.0 <= summary["uptime_s"] < HOUR_S, summary["uptime_s"]
