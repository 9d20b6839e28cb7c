"""The figures docs/replay.md gives for the shared Mooncake trace are what the simulation
gives on it today -- the whole trace (``replay --simulate --capacity 1k,4k,16k,64k``), each
half from a cold cache, and the mean over re-timed samples 0, 1 and 2 (``--retime``): a
change to the simulator or to a policy that moves them has to move the doc with it."""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.replay.report import gap_closed, gap_share
from lmcache_tiers.replay.retime import RATE_ORACLE, RateOracle, best_bandwidth, fit_rates, rate_bound, retime
from lmcache_tiers.replay.simulate import (
    BELADY,
    EXACT_LRU,
    INFINITE,
    CapacityPoint,
    policy_factories,
    simulate_curve,
)
from lmcache_tiers.replay.trace import Trace, read_trace

REPOSITORY = Path(__file__).resolve().parents[3]
DOC = REPOSITORY / "docs" / "replay.md"
SECTION = "## Measured on the shared Mooncake synthetic trace"
TRACE_ENV = "LMCACHE_TIERS_REPLAY_TRACE"


def _shared_trace() -> Path:
    configured = os.environ.get(TRACE_ENV)
    path = (
        Path(configured)
        if configured
        else REPOSITORY.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
    )
    if not path.is_file():
        pytest.skip(f"trace {path} is absent (set {TRACE_ENV} to its path)")
    return path


def _tables() -> list[list[list[str]]]:
    """The markdown tables of the doc's section on the shared trace, as rows of cells
    (header first, the alignment row left out), with bold marks removed."""
    text = DOC.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.find("\n## ", len(SECTION))]
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            cells = [cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r"-*:?-+:?", cell) for cell in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _table_headed(first: str, second: str) -> list[list[str]]:
    for table in _tables():
        if table[0][:2] == [first, second]:
            return table
    raise AssertionError(f"docs/replay.md has no table headed {first!r}, {second!r} in {SECTION!r}")


def _blocks(label: str) -> int:
    return int(label.replace(",", ""))


def _share(closed: float | None) -> str:
    return "-" if closed is None else f"{closed * 100:.1f} %"


def _factories(names: list[str]) -> dict[str, Any]:
    try:
        return policy_factories(load_registry(), names)
    except ConfigError as exc:  # a policy the doc names is not installed here
        pytest.skip(f"the doc's policies are not all installed: {exc}")


@pytest.fixture(scope="module")
def curve() -> dict[int, CapacityPoint]:
    header, *rows = _table_headed("capacity (blocks)", EXACT_LRU)
    factories = _factories([name for name in header[1:] if name not in (EXACT_LRU, BELADY, INFINITE)])
    trace = read_trace(_shared_trace())
    points = simulate_curve(trace, factories, [_blocks(row[0]) for row in rows])
    return {point.capacity_blocks: point for point in points}


def test_the_miss_ratio_table_is_what_the_simulation_gives(curve: dict[int, CapacityPoint]) -> None:
    header, *rows = _table_headed("capacity (blocks)", EXACT_LRU)
    wrong = []
    for row in rows:
        point = curve[_blocks(row[0])]
        for name, cell in zip(header[1:], row[1:], strict=True):
            measured = f"{point.run(name).miss_ratio:.4f}"
            if cell != measured:
                wrong.append(
                    f"{name} at {row[0]} blocks: the doc says {cell}, the simulation gives {measured}"
                )
    assert not wrong, "; ".join(wrong)


def test_the_whole_trace_gap_shares_are_what_the_simulation_gives(curve: dict[int, CapacityPoint]) -> None:
    header, *rows = _table_headed("capacity", "ARC")
    # the columns of the whole trace are those named by a policy alone (not "..., 1st / 2nd half")
    columns = [(index, name) for index, name in enumerate(header) if index and "," not in name]
    assert columns, "the gap table names no policy"
    wrong = []
    for row in rows:
        point = curve[_blocks(row[0])]
        for index, name in columns:
            closed = gap_closed(point, name)
            measured = _share(closed)
            if row[index] != measured:
                wrong.append(
                    f"{name} at {row[0]} blocks: the doc says {row[index]}, the simulation gives {measured}"
                )
    assert not wrong, "; ".join(wrong)


def test_the_gap_shares_on_each_half_are_what_the_simulation_gives() -> None:
    header, *rows = _table_headed("capacity", "ARC")
    suffix = ", 1st / 2nd half"
    columns = [
        (index, name.removesuffix(suffix)) for index, name in enumerate(header) if name.endswith(suffix)
    ]
    assert columns, "the gap table has no columns of the halves"
    trace = read_trace(_shared_trace())
    middle = len(trace.requests) // 2
    halves = [Trace(trace.path, trace.requests[:middle]), Trace(trace.path, trace.requests[middle:])]
    factories = _factories([name for _, name in columns])
    rows = [row for row in rows if any(row[index] for index, _ in columns)]
    capacities = [_blocks(row[0]) for row in rows]
    curves = [
        {point.capacity_blocks: point for point in simulate_curve(half, factories, capacities)}
        for half in halves
    ]
    wrong = []
    for row in rows:
        for index, name in columns:
            shares = [gap_closed(curve[_blocks(row[0])], name) for curve in curves]
            measured = " / ".join(_share(share).removesuffix(" %") for share in shares) + " %"
            if row[index] != measured:
                wrong.append(
                    f"{name} at {row[0]} blocks: the doc says {row[index]}, the simulation gives {measured}"
                )
    assert not wrong, "; ".join(wrong)


def test_the_re_timed_shares_are_what_the_simulation_gives() -> None:
    for table in _tables():
        if table[0][-1] == "bound on any online policy":
            header, *rows = table
            break
    else:
        raise AssertionError("docs/replay.md has no table of the re-timed samples")
    policies = [name for name in header[1:-1] if name != RATE_ORACLE]
    factories = _factories(policies)
    trace = read_trace(_shared_trace())
    bandwidth = best_bandwidth(trace)
    model = fit_rates(trace, float(bandwidth))
    capacities = [_blocks(row[0]) for row in rows]
    shares: dict[tuple[int, str], list[float]] = {}
    for seed in (0, 1, 2):
        sample = retime(trace, float(bandwidth), seed, model)
        with_oracle = {**factories, RATE_ORACLE: lambda sample=sample: RateOracle(sample)}
        points = simulate_curve(sample.trace, with_oracle, capacities)
        bounds = rate_bound(sample, capacities, trace.block_references)
        for point in points:
            for name in [*policies, RATE_ORACLE]:
                closed = gap_closed(point, name)
                assert closed is not None
                shares.setdefault((point.capacity_blocks, name), []).append(closed)
            bound = gap_share(point, bounds[point.capacity_blocks])
            assert bound is not None
            shares.setdefault((point.capacity_blocks, header[-1]), []).append(bound)
    wrong = []
    for row in rows:
        for name, cell in zip(header[1:], row[1:], strict=True):
            measured = _share(statistics.mean(shares[(_blocks(row[0]), name)]))
            if cell != measured:
                wrong.append(
                    f"{name} at {row[0]} blocks: the doc says {cell}, the simulation gives {measured}"
                )
    assert not wrong, "; ".join(wrong)
