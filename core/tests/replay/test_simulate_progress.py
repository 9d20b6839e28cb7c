"""The simulation's progress bar counts finished runs: it was told of each run as it
started and added one each time, so it was full while the last run still ran (on a long
trace, Belady at the largest capacity: minutes at 100 %)."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from lmcache_tiers.cli import replay_cmd
from lmcache_tiers.cli.main import build_app
from lmcache_tiers.replay import simulate
from lmcache_tiers.replay.trace import Trace


def test_the_bar_counts_runs_once_they_have_finished(
    synthetic_trace: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    bars: list[Any] = []
    make_bar = replay_cmd._progress

    def recorded_bar(in_bytes: bool = False) -> Any:
        bars.append(make_bar(in_bytes))
        return bars[-1]

    def bar_at_start(run: Any) -> Any:
        def started(*args: Any, **kwargs: Any) -> Any:
            task = bars[-1].tasks[0]
            shown.append((task.completed, task.total))
            return run(*args, **kwargs)

        return started

    shown: list[tuple[float, float | None]] = []  # the bar as each run started
    monkeypatch.setattr(replay_cmd, "_progress", recorded_bar)
    monkeypatch.setattr(simulate, "simulate_policy", bar_at_start(simulate.simulate_policy))
    monkeypatch.setattr(simulate, "belady_run", bar_at_start(simulate.belady_run))

    args = ["replay", synthetic_trace.path, "--simulate", "--capacity", "8,64", "--policy", "LRU", "--json"]
    result = CliRunner().invoke(build_app(with_plugin_commands=False), args)

    assert result.exit_code == 0, result.output
    runs = 2 * 3  # two capacities: exact LRU, LRU and Belady at each
    assert shown == [(started, runs) for started in range(runs)]  # none counted before it ended
    assert bars[-1].tasks[0].completed == runs  # and every one once it had
