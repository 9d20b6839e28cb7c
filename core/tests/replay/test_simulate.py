from itertools import pairwise

import pytest
from typer.testing import CliRunner

from lmcache_tiers.cli.main import build_app
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.replay.belady import infinite
from lmcache_tiers.replay.simulate import (
    BELADY,
    EXACT_LRU,
    INFINITE,
    default_capacities,
    policy_factories,
    simulate_curve,
    simulate_policy,
)
from lmcache_tiers.replay.trace import Trace


def test_every_installed_policy_is_simulated_once() -> None:
    names = list(policy_factories(load_registry()))
    assert names[0] == EXACT_LRU
    assert {"LRU", "ARC", "S3FIFO", "PREFIX_LFU", "noop"} <= set(names)
    assert "S3-FIFO" not in names, "an alias is the same policy"
    assert list(policy_factories(load_registry(), ["s3-fifo"])) == [EXACT_LRU, "S3-FIFO"]


def test_a_large_l2_behind_l1_holds_everything_seen(synthetic_trace: Trace) -> None:
    longest = max(len(request.hash_ids) for request in synthetic_trace.requests)
    run = simulate_policy(
        synthetic_trace,
        EXACT_LRU,
        policy_factories(load_registry())[EXACT_LRU],
        longest,
        l2_capacity_blocks=10**6,
    )
    assert run.l2_hit_blocks > 0
    assert run.hit_blocks == infinite(synthetic_trace).hit_blocks
    l1_only = simulate_policy(
        synthetic_trace, EXACT_LRU, policy_factories(load_registry())[EXACT_LRU], longest
    )
    assert l1_only.hit_blocks <= run.hit_blocks


def test_a_curve_has_every_policy_and_both_bounds(synthetic_trace: Trace) -> None:
    factories = policy_factories(load_registry(), ["LRU", "PREFIX_LFU"])
    steps: list[tuple[str, int]] = []
    points = simulate_curve(
        synthetic_trace, factories, [8, 64], progress=lambda label, finished: steps.append((label, finished))
    )
    assert [point.capacity_blocks for point in points] == [8, 64]
    runs = 2 * (len(factories) + 1)
    assert [finished for _, finished in steps] == [*range(runs), runs]  # as each starts, then the end
    assert steps[0] == (f"{EXACT_LRU} @ 8", 0) and steps[-2] == (f"{BELADY} @ 64", runs - 1)
    for point in points:
        assert [run.policy for run in point.runs] == [EXACT_LRU, "LRU", "PREFIX_LFU", BELADY, INFINITE]
        optimal = point.run(BELADY).hit_blocks
        assert all(run.hit_blocks <= optimal for run in point.runs[:3])
        assert point.run(INFINITE).hit_blocks >= optimal
        assert point.run(BELADY).notes == []  # a prefix forest: the bound is achieved
    assert points[0].run(EXACT_LRU).hit_blocks <= points[1].run(EXACT_LRU).hit_blocks


def test_default_capacities_reach_the_working_set(synthetic_trace: Trace) -> None:
    capacities = default_capacities(synthetic_trace)
    assert capacities[0] == 256
    assert capacities[-1] >= synthetic_trace.unique_blocks()
    assert all(b == 2 * a for a, b in pairwise(capacities))


@pytest.mark.parametrize(
    "option", [["--capacity", ""], ["--capacity", ",,"], ["--l2-capacity", " "], ["--policy", ""]]
)
def test_an_empty_simulation_option_is_refused_not_read_as_the_default(
    synthetic_trace: Trace, option: list[str]
) -> None:
    app = build_app(with_plugin_commands=False)
    result = CliRunner().invoke(app, ["replay", synthetic_trace.path, "--simulate", "--json", *option])
    assert result.exit_code == 2, result.output
    assert f"{option[0]} {option[1]!r} names nothing" in result.output


@pytest.mark.timeout(60)
def test_a_huge_reads_per_hit_is_refused_not_simulated_for_ever(synthetic_trace: Trace) -> None:
    app = build_app(with_plugin_commands=False)
    command = ["replay", synthetic_trace.path, "--simulate", "--json", "--capacity", "8"]
    result = CliRunner().invoke(app, [*command, "--reads-per-hit", str(10**20)])
    assert result.exit_code == 2, result.output
    assert "--reads-per-hit" in result.output
