"""Tables for people and documents for machines: simulation curves and replay results."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rich.markup import escape
from rich.table import Table

from lmcache_tiers.replay.simulate import BELADY, EXACT_LRU, INFINITE, CapacityPoint, TierSettings
from lmcache_tiers.replay.trace import Trace


def capacity_label(point: CapacityPoint) -> str:
    if point.l2_capacity_blocks is None:
        return f"{point.capacity_blocks:,}"
    return f"{point.capacity_blocks:,} + L2 {point.l2_capacity_blocks:,}"


def policy_names(points: Sequence[CapacityPoint]) -> list[str]:
    return [run.policy for run in points[0].runs] if points else []


def curve_table(points: Sequence[CapacityPoint], *, title: str, oracles: Collection[str] = ()) -> Table:
    """Miss ratio of every policy at every capacity (lower is better).

    ``oracles`` (analysis runs that know the trace) are shown in italics and never marked
    as the best policy.
    """
    table = Table(title=title, title_justify="left")
    table.add_column("capacity (blocks)", justify="right")
    names = policy_names(points)
    limits = {BELADY, INFINITE, *oracles}
    for name in names:
        style = "bold" if name in (BELADY, INFINITE) else "italic" if name in oracles else None
        table.add_column(name, justify="right", style=style)
    for point in points:
        measured = [run for run in point.runs if run.total_blocks]
        best = min((run.miss_ratio for run in measured if run.policy not in limits), default=None)
        cells = []
        for run in point.runs:
            if not run.total_blocks:
                cells.append("n/a")  # a trace without blocks: no miss ratio to show
                continue
            text = f"{run.miss_ratio:.4f}"
            if best is not None and run.miss_ratio == best and run.policy not in limits:
                text = f"[green]{text}[/]"
            cells.append(text)
        table.add_row(capacity_label(point), *cells)
    return table


def gap_table(points: Sequence[CapacityPoint]) -> Table | None:
    """How much of the exact-LRU -> Belady gap each policy closes at each capacity."""
    names = [name for name in policy_names(points) if name not in (EXACT_LRU, BELADY, INFINITE)]
    if not names:
        return None
    table = Table(title="share of the exact-LRU -> Belady hit-rate gap closed", title_justify="left")
    table.add_column("capacity (blocks)", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for point in points:
        cells = []
        for name in names:
            closed = gap_closed(point, name)
            cells.append("-" if closed is None else f"{closed:+.1%}")
        table.add_row(capacity_label(point), *cells)
    return table


def gap_closed(point: CapacityPoint, policy: str) -> float | None:
    return gap_share(point, point.run(policy).hit_rate)


def gap_share(point: CapacityPoint, hit_rate: float) -> float | None:
    """The share of the exact-LRU -> Belady hit-rate gap that ``hit_rate`` closes."""
    lru, optimal = point.run(EXACT_LRU).hit_rate, point.run(BELADY).hit_rate
    if optimal - lru <= 1e-12:
        return None
    return (hit_rate - lru) / (optimal - lru)


def bound_table(points: Sequence[CapacityPoint], bounds: Mapping[int, float]) -> Table:
    """The online bound of a re-timed sample next to exact LRU and Belady on that sample."""
    table = Table(
        title="bound on any online policy's expected hit rate on the re-timed model", title_justify="left"
    )
    for column in ("capacity (blocks)", "exact LRU", "online bound", "Belady", "gap share of the bound"):
        table.add_column(column, justify="right")
    for point in points:
        bound = bounds[point.capacity_blocks + (point.l2_capacity_blocks or 0)]
        share = gap_share(point, bound)
        table.add_row(
            capacity_label(point),
            f"{point.run(EXACT_LRU).hit_rate:.4f}",
            f"{bound:.4f}",
            f"{point.run(BELADY).hit_rate:.4f}",
            "-" if share is None else f"{share:+.1%}",
        )
    return table


def timing_table(points: Sequence[CapacityPoint], trace: Trace) -> Table:
    """Seconds per run of each policy over the trace's block references."""
    table = Table(
        title=f"simulation time ({trace.block_references:,} block references per run)", title_justify="left"
    )
    table.add_column("policy")
    table.add_column("seconds per run (mean)", justify="right")
    table.add_column("block references/s", justify="right")
    for name in policy_names(points):
        runs = [point.run(name) for point in points]
        if name == INFINITE:
            runs = runs[:1]
        mean = sum(run.seconds for run in runs) / len(runs)
        rate = trace.block_references / mean if mean > 0 else float("inf")
        table.add_row(name, f"{mean:.3f}", f"{rate:,.0f}")
    return table


def trace_summary(trace: Trace) -> dict[str, Any]:
    return {
        "path": trace.path,
        "requests": len(trace.requests),
        "block_references": trace.block_references,
        "unique_blocks": trace.unique_blocks(),
        "input_tokens": trace.input_tokens,
        "chain_conflicts": trace.chain_conflicts(),
    }


def simulation_document(
    trace: Trace,
    points: Sequence[CapacityPoint],
    settings: TierSettings,
    *,
    analysis: Mapping[str, Any] | None = None,
    bounds: Mapping[int, float] | None = None,
) -> dict[str, Any]:
    document = {
        "trace": trace_summary(trace),
        "settings": {
            "reads_per_hit": settings.reads_per_hit,
            "trigger_watermark": settings.trigger_watermark,
            "eviction_ratio": settings.eviction_ratio,
            "l2_policy": settings.l2_policy,
            "retain_loaded": settings.retain_loaded,
        },
        "points": [
            {
                "capacity_blocks": point.capacity_blocks,
                "l2_capacity_blocks": point.l2_capacity_blocks,
                "runs": [run.to_dict() for run in point.runs],
                "gap_closed": {
                    run.policy: gap_closed(point, run.policy)
                    for run in point.runs
                    if run.policy not in (EXACT_LRU, BELADY, INFINITE)
                },
                **_bound_fields(point, bounds),
            }
            for point in points
        ],
    }
    if analysis is not None:
        document["analysis"] = dict(analysis)
    return document


def _bound_fields(point: CapacityPoint, bounds: Mapping[int, float] | None) -> dict[str, Any]:
    if bounds is None:
        return {}
    bound = bounds[point.capacity_blocks + (point.l2_capacity_blocks or 0)]
    return {"online_bound_hit_rate": bound, "online_bound_gap_closed": gap_share(point, bound)}


def _pct(value: float) -> str:
    return f"{value:.2%}"


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


#: what the table shows for a figure only the server counts when its counters are unknown
UNKNOWN = "unknown"


def _pct_or_unknown(value: float | None) -> str:
    return UNKNOWN if value is None else _pct(value)


def _bytes_or_unknown(value: float | None) -> str:
    return UNKNOWN if value is None else _bytes(value)


def _count_or_unknown(value: int | None) -> str:
    return UNKNOWN if value is None else f"{value:,}"


def replay_table(document: dict[str, Any]) -> Table:
    """A replay report document (``ReplayReport.to_dict``) as a table.  A figure of the
    server's counters that could not be read shows as "unknown", never as 0."""
    table = Table(
        title=f"replay ({document['mode']}: {document['target']}, {document['clients']} client(s))",
        title_justify="left",
        show_header=False,
    )
    table.add_column(style="bold cyan", no_wrap=True)
    # folded, never cut: a word longer than the column (a URL, a path in a 'partial'
    # reason) lost its end to an ellipsis, even in a table off a terminal made wide for it
    table.add_column(overflow="fold")
    rates, moved = document["hit_rate"], document["bytes"]
    latency = document["lookup_latency_ms"]
    if document.get("stopped"):
        table.add_row("partial", f"[yellow]{escape(document['stopped'])}[/]")
    table.add_row(
        "requests",
        f"{document['requests']:,} in {document['seconds']:.1f} s ({document['requests_per_s']:,.0f}/s)",
    )
    for unit in ("blocks", "tokens"):
        # Requests that named no block (or no token) measured no hit rate: 0 % would read
        # as a cache that missed everything.
        shown = (
            f"{_pct(rates[unit])} total, {_pct_or_unknown(rates[f'l1_{unit}'])} L1, "
            f"{_pct_or_unknown(rates[f'l2_{unit}'])} L2"
            if document[unit]
            else f"n/a (no {unit} in the requests replayed)"
        )
        table.add_row(f"prefix hit rate ({unit})", shown)
    table.add_row(
        "L1 bytes", f"{_bytes(moved['l1_stored'])} stored, {_bytes(moved['l1_retrieved'])} retrieved"
    )
    table.add_row(
        "L2 bytes",
        f"{_bytes_or_unknown(moved['l2_stored'])} stored, {_bytes_or_unknown(moved['l2_loaded'])} loaded",
    )
    evicted = document["evicted_blocks"]
    table.add_row(
        "evicted blocks", f"L1 {_count_or_unknown(evicted['l1'])}, L2 {_count_or_unknown(evicted['l2'])}"
    )
    if latency["p50"] is not None:
        table.add_row("lookup latency", f"p50 {latency['p50']:.3f} ms, p99 {latency['p99']:.3f} ms")
    problems = {
        "refused stores (L1 full)": document["refused_stores"],
        "short retrieves": document["short_retrieves"],
        "corrupt blocks": document["corrupt_blocks"],
        "failed requests": document["failed_requests"],
    }
    for label, count in problems.items():
        if count:
            table.add_row(label, f"[red]{count:,}[/]")
    if document["server_failures"] is None:
        table.add_row("server failures", UNKNOWN)
    else:
        for reason, count in sorted(document["server_failures"].items()):
            table.add_row(f"server: {reason}", f"[red]{count:,}[/]")
    return table
