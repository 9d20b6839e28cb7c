"""Belady at a two-tier point is one cache of L1 + L2 blocks, a bound on the total hits:
``--json`` said so nowhere, and put every hit under ``l1_hit_blocks`` -- more hits than
the point's L1 could ever hold.  Each run now says whether its hits count the tiers as
one cache (``combined_tiers``); ``l1_hit_blocks`` and ``l2_hit_blocks`` stay integers that
add up to ``hit_blocks``, for readers that add them."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from lmcache_tiers.cli.main import build_app
from lmcache_tiers.replay.simulate import BELADY, EXACT_LRU, INFINITE
from lmcache_tiers.replay.trace import Trace


def _simulated(trace: Trace, *options: str) -> list[dict[str, Any]]:
    args = ["replay", trace.path, "--simulate", "--policy", "LRU", "--json", *options]
    result = CliRunner().invoke(build_app(with_plugin_commands=False), args)
    assert result.exit_code == 0, result.output
    points: list[dict[str, Any]] = json.loads(result.stdout)["points"]
    return points


def _runs(point: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {run["policy"]: run for run in point["runs"]}


def test_belady_at_a_two_tier_point_says_its_hits_are_of_l1_and_l2_together(synthetic_trace: Trace) -> None:
    (point,) = _simulated(synthetic_trace, "--capacity", "8", "--l2-capacity", "64")
    runs = _runs(point)
    belady = runs[BELADY]
    assert belady["combined_tiers"] is True
    assert (belady["capacity_blocks"], belady["l2_capacity_blocks"]) == (8, 64)
    # readable as before: integers that add up to the total
    assert belady["l1_hit_blocks"] + belady["l2_hit_blocks"] == belady["hit_blocks"]
    # the simulated policies' hits are split by tier, as measured
    for name in (EXACT_LRU, "LRU"):
        assert runs[name]["combined_tiers"] is False
        assert runs[name]["l2_hit_blocks"] > 0
        assert runs[name]["hit_blocks"] <= belady["hit_blocks"]
    assert runs[INFINITE]["combined_tiers"] is False  # one unbounded cache, no tiers to split


def test_belady_at_an_l1_only_point_is_an_l1_figure(synthetic_trace: Trace) -> None:
    (point,) = _simulated(synthetic_trace, "--capacity", "8")
    belady = _runs(point)[BELADY]
    assert belady["combined_tiers"] is False
    assert (belady["l1_hit_blocks"], belady["l2_hit_blocks"]) == (belady["hit_blocks"], 0)
