"""Eviction designs studied against ``PREFIX_LFU`` and not shipped, with the figures they reach.

Each design of ``bench/learned_eviction.py`` is tuned on the first half of the trace (the
grid point with the best sum of LRU -> Belady gap shares over ``--capacities``), then run
unchanged on the second half and the whole trace, every run from a cold cache through the
simulator's server model.  ``PREFIX_LFU`` (the installed plugin, default config) and
Belady's optimum are printed beside them.  Two more studies:

* retention in hindsight: keep times per class (use count x last-gap bucket) fitted to the
  whole trace with the capacity met on average over time, the same keep times in a plain
  cache of exactly C blocks that evicts the earliest expiry first, and how many blocks
  they hold with no size limit (on average, and in the trace's busy stretches);
* frequency in hindsight: the C blocks the whole trace uses most, held from their first
  use on;
* admission: ``PREFIX_LFU`` with chunks put first in line for eviction when an oracle says
  their prompt tree never comes back, or when the length of the tree's first request
  falls in a bucket where fewer than 35 % of trees came back (rates from the whole trace).

    python bench/eviction_experiments.py                      # the shared Mooncake trace
    python bench/eviction_experiments.py --trace my.jsonl --capacities 1000,4000 --json

A study of rejected designs, run on demand (not part of ``run_all.py``); about a minute.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.policies import EvictionPolicy
from lmcache_tiers.registry import Kind
from lmcache_tiers.replay.simulate import ExactLRU, belady_run, simulate_policy
from lmcache_tiers.replay.trace import KeySpace, Trace, read_trace
from lmcache_tiers.storage import build_policy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_args import BenchParser
from learned_eviction import HitDensityPolicy, KeepTimePolicy, OptGenPolicy, chunk_class

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = os.environ.get(
    "LMCACHE_TIERS_REPLAY_TRACE", str(ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl")
)
Factory = Callable[[], Any]


def prefix_lfu() -> EvictionPolicy:
    built: EvictionPolicy = build_policy(load_registry(), Kind.EVICTION_POLICY, "PREFIX_LFU")
    return built


def designs() -> dict[str, list[tuple[dict[str, Any], Factory]]]:
    """Each design's grid: (parameters, factory)."""

    def grid(make: Callable[..., Any], **axes: Sequence[Any]) -> list[tuple[dict[str, Any], Factory]]:
        names = list(axes)
        points: list[dict[str, Any]] = [{}]
        for name in names:
            points = [{**point, name: value} for point in points for value in axes[name]]
        return [(point, lambda point=point: make(**point)) for point in points]

    return {
        "PREFIX_LFU": [({}, prefix_lfu)],
        "keep times, chunk classes": grid(KeepTimePolicy, budget=(0.25, 0.5, 1.0), use_cap=(4, 8)),
        "keep times, tree classes": grid(
            lambda **kw: KeepTimePolicy(tree_classes=True, **kw), budget=(0.25, 0.5, 1.0), use_cap=(4, 8)
        ),
        "OPTgen predictor": grid(OptGenPolicy, horizon=(2, 8, 32), threshold=(0.3, 0.5)),
        "OPTgen + PREFIX_LFU rank": grid(
            lambda **kw: OptGenPolicy(credit=2.0, penalty=1.0, **kw),
            horizon=(1, 2, 4),
            threshold=(0.3, 0.5),
            use_length=(False, True),
        ),
        "hit density (LHD)": grid(HitDensityPolicy, use_length=(False, True), use_gap=(False, True)),
    }


class Study:
    """Baselines (exact LRU, Belady) per part of the trace and capacity, and gap shares."""

    def __init__(self, trace: Trace) -> None:
        middle = len(trace.requests) // 2
        self.parts = {
            "first half": Trace(f"{trace.path} (first half)", trace.requests[:middle]),
            "second half": Trace(f"{trace.path} (second half)", trace.requests[middle:]),
            "whole": trace,
        }
        self._bases: dict[tuple[str, int], tuple[float, float]] = {}

    def base(self, part: str, capacity: int) -> tuple[float, float]:
        if (part, capacity) not in self._bases:
            trace = self.parts[part]
            lru = simulate_policy(trace, "exact LRU", ExactLRU, capacity).miss_ratio
            self._bases[(part, capacity)] = (lru, belady_run(trace, capacity).miss_ratio)
        return self._bases[(part, capacity)]

    def share(self, part: str, capacity: int, miss: float) -> float:
        lru, optimum = self.base(part, capacity)
        return (lru - miss) / (lru - optimum) if lru > optimum else 0.0

    def run(self, part: str, capacity: int, factory: Factory) -> dict[str, float]:
        result = simulate_policy(self.parts[part], "study", factory, capacity)
        return {
            "miss_ratio": result.miss_ratio,
            "share": self.share(part, capacity, result.miss_ratio),
            "seconds": result.seconds,
        }


def tune_and_test(study: Study, capacities: Sequence[int], extra: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for name, grid in designs().items():
        best: tuple[float, dict[str, Any], Factory, list[float]] | None = None
        for params, factory in grid:
            shares = [study.run("first half", c, factory)["share"] for c in capacities]
            if best is None or sum(shares) > best[0]:
                best = (sum(shares), params, factory, shares)
        assert best is not None
        _, params, factory, first = best
        row: dict[str, Any] = {
            "design": name,
            "params": params,
            "first half": dict(zip(capacities, first, strict=True)),
        }
        row["second half"] = {c: study.run("second half", c, factory)["share"] for c in capacities}
        row["whole"] = {c: study.run("whole", c, factory) for c in [*capacities, *extra]}
        rows.append(row)
        print(f"  {name}: tuned {params}", file=sys.stderr, flush=True)
    return rows


# -- retention in hindsight --------------------------------------------------------------------


def _classed_intervals(trace: Trace) -> tuple[dict[Any, list[int]], int]:
    """Reuse gaps (``None``-free, never reused = a huge gap) by the class the interval began in."""
    never = 1 << 40
    tick, last, uses, began = 0, {}, Counter[int](), {}
    intervals: dict[Any, list[int]] = defaultdict(list)
    for request in trace.requests:
        for block in request.hash_ids:
            gap = tick - last[block] if block in last else None
            if gap is not None:
                intervals[began[block]].append(gap)
            uses[block] += 1
            last[block] = tick
            began[block] = chunk_class(uses[block], gap, 0, use_cap=6, use_gap=True, use_length=False)
        tick += len(request.hash_ids)
    for block in last:
        intervals[began[block]].append(never)
    return intervals, tick


def hindsight_keep_times(trace: Trace, capacity: int) -> tuple[float, dict[Any, int]]:
    """Keep times maximising block hits with ``capacity`` met on average; and their miss ratio."""
    intervals, span = _classed_intervals(trace)
    candidates = [int(100 * 2 ** (step / 2)) for step in range(30)]
    options: dict[Any, list[tuple[int, int, int]]] = {}
    for cls, gaps in intervals.items():
        gaps.sort()
        sums = [0]
        for gap in gaps:
            sums.append(sums[-1] + gap)
        options[cls] = [(0, 0, 0)]
        for keep in candidates:
            caught = bisect.bisect_left(gaps, keep)
            options[cls].append((caught, sums[caught] + keep * (len(gaps) - caught), keep))
    best_hits, best_keep = 0, {}
    low, high = 1e-9, 1.0
    for _ in range(50):
        price = math.sqrt(low * high)
        chosen = {cls: max(opts, key=lambda o: o[0] - price * o[1]) for cls, opts in options.items()}
        if sum(option[1] for option in chosen.values()) <= capacity * span:
            hits = sum(option[0] for option in chosen.values())
            if hits > best_hits:
                best_hits, best_keep = hits, {cls: option[2] for cls, option in chosen.items()}
            high = price
        else:
            low = price
    return 1 - best_hits / trace.block_references, best_keep


def _use(block: int, tick: int, last: dict[int, int], uses: Counter[int]) -> Any:
    """Count a use of ``block`` at ``tick``; the class of the interval it begins."""
    gap = tick - last[block] if block in last else None
    uses[block] += 1
    last[block] = tick
    return chunk_class(uses[block], gap, 0, use_cap=6, use_gap=True, use_length=False)


def expiry_cache(trace: Trace, capacity: int, keep: dict[Any, int]) -> float:
    """Miss ratio of exactly ``capacity`` blocks under those keep times, earliest expiry out first."""
    tick, last, uses = 0, {}, Counter[int]()
    expiry: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    hits = 0
    for request in trace.requests:
        in_prefix = True
        for depth, block in enumerate(request.hash_ids):
            in_prefix = in_prefix and block in expiry
            hits += in_prefix
            expiry[block] = tick + keep.get(_use(block, tick, last, uses), 0)
            heapq.heappush(heap, (expiry[block], -depth, block))
            while len(expiry) > capacity:
                when, _, victim = heapq.heappop(heap)
                if expiry.get(victim) == when:
                    del expiry[victim]
        tick += len(request.hash_ids)
    return 1 - hits / trace.block_references


def optgen_calibration(study: Study, capacity: int) -> dict[str, Any]:
    """What OPTgen labels kept over the whole trace (no decay), next to Belady's hits."""
    trace = study.parts["whole"]
    built: list[OptGenPolicy] = []

    def make() -> OptGenPolicy:
        built.append(OptGenPolicy(horizon=32, threshold=0.5, decay_every=1 << 62))
        return built[-1]

    simulate_policy(trace, "OPTgen", make, capacity)
    policy = built[0]
    kept_by_uses: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for cls, seen in policy.seen.items():
        kept_by_uses[cls[0]][0] += policy.kept[cls]
        kept_by_uses[cls[0]][1] += seen
    return {
        "kept": sum(policy.kept.values()),
        "belady_hits": belady_run(trace, capacity).hit_blocks,
        "kept_share_by_uses": {uses: k / n for uses, (k, n) in sorted(kept_by_uses.items()) if n},
    }


# -- admission -----------------------------------------------------------------------------------


class FirstInLine:
    """Another policy, except that chunks ``doomed`` says will not be reused go first.

    A doomed chunk leaves that line once read; the rest is the wrapped policy's order.
    """

    def __init__(self, inner: EvictionPolicy, doomed: Callable[[ObjectKey], bool]) -> None:
        self.inner, self.doomed = inner, doomed
        self.line: dict[ObjectKey, None] = {}
        self.read: set[ObjectKey] = set()

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self.inner.on_keys_written(keys)
        for key in reversed(keys):
            if key not in self.read and self.doomed(key):
                self.line.pop(key, None)
                self.line[key] = None

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        self.inner.on_keys_read(keys)
        for key in keys:
            self.read.add(key)
            self.line.pop(key, None)

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        self.inner.on_keys_removed(keys)
        for key in keys:
            self.line.pop(key, None)
            self.read.discard(key)

    def victims(self) -> Iterator[ObjectKey]:
        first = list(self.line)
        yield from first
        chosen = set(first)
        for key in self.inner.victims():
            if key not in chosen:
                yield key


def admission(
    study: Study, capacities: Sequence[int], threshold: float = 0.35
) -> dict[str, dict[int, float]]:
    trace = study.parts["whole"]
    keyspace = KeySpace()
    tree_of: dict[ObjectKey, int] = {}
    sent = Counter[int]()
    first_length: dict[int, int] = {}
    for request in trace.requests:
        tree = request.hash_ids[0]
        sent[tree] += 1
        first_length.setdefault(tree, len(request.hash_ids))
        for key in keyspace.keys(request.hash_ids):
            tree_of.setdefault(key, tree)
    by_bucket: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for tree, length in first_length.items():
        by_bucket[int(math.log2(length + 1))][0] += 1
        by_bucket[int(math.log2(length + 1))][1] += sent[tree] > 1
    unlikely = {bucket for bucket, (trees, back) in by_bucket.items() if back / trees < threshold}

    def never_back(key: ObjectKey) -> bool:
        return sent[tree_of[key]] == 1

    def short_odds(key: ObjectKey) -> bool:
        return int(math.log2(first_length[tree_of[key]] + 1)) in unlikely

    return {
        "tree never returns (oracle)": {
            c: study.run("whole", c, lambda: FirstInLine(prefix_lfu(), never_back))["share"]
            for c in capacities
        },
        f"first request's length: return rate < {threshold:.0%}": {
            c: study.run("whole", c, lambda: FirstInLine(prefix_lfu(), short_odds))["share"]
            for c in capacities
        },
        "return rate by first-request length": {
            bucket: back / trees for bucket, (trees, back) in sorted(by_bucket.items())
        },
    }


def keep_time_occupancy(trace: Trace, keep: dict[Any, int]) -> dict[str, float]:
    """What those keep times hold with no size limit: blocks held at the start of each request
    (each block for its class's keep time after every use), weighted by the request's
    length as the fit's budget is: mean, 90th percentile, most."""
    tick, last, uses = 0, {}, Counter[int]()
    expiry: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    held: list[tuple[int, int]] = []  # (blocks held, ticks they are held for)
    for request in trace.requests:
        while heap and heap[0][0] <= tick:  # a block is held for ticks [use, use + keep)
            when, block = heapq.heappop(heap)
            if expiry.get(block) == when:
                del expiry[block]
        held.append((len(expiry), len(request.hash_ids)))
        for block in request.hash_ids:
            expiry[block] = tick + keep.get(_use(block, tick, last, uses), 0)
            heapq.heappush(heap, (expiry[block], block))
        tick += len(request.hash_ids)
    held.sort()
    total = sum(weight for _, weight in held)
    p90, running = held[-1][0], 0
    for blocks, weight in held:
        running += weight
        if running >= 0.9 * total:
            p90 = blocks
            break
    return {"mean": sum(b * w for b, w in held) / total, "p90": p90, "max": held[-1][0]}


def most_used_held(trace: Trace, capacity: int) -> float:
    """Miss ratio of holding the ``capacity`` blocks the whole trace uses most, each from its
    first use on (a static choice made with the whole trace in hand)."""
    counts = Counter(block for request in trace.requests for block in request.hash_ids)
    chosen = {block for block, _ in counts.most_common(capacity)}
    seen: set[int] = set()
    hits = 0
    for request in trace.requests:
        for block in request.hash_ids:
            if block not in chosen or block not in seen:
                break
            hits += 1
        seen.update(request.hash_ids)
    return 1 - hits / trace.block_references


def show(report: dict[str, Any], capacities: Sequence[int], extra: Sequence[int]) -> None:
    print(f"trace {report['trace']}; shares of each part's own exact-LRU -> Belady gap")
    for part in ("first half", "second half", "whole"):
        bases = "  ".join(
            f"{c}: LRU {b[0]:.4f} Belady {b[1]:.4f}" for c, b in report["baselines"][part].items()
        )
        print(f"  {part}: {bases}")
    for row in report["designs"]:
        first = " / ".join(f"{row['first half'][c]:+.1%}" for c in capacities)
        second = " / ".join(f"{row['second half'][c]:+.1%}" for c in capacities)
        whole = " / ".join(f"{row['whole'][c]['miss_ratio']:.4f}" for c in [*capacities, *extra])
        seconds = max(run["seconds"] for run in row["whole"].values())
        print(
            f"{row['design']:28s} 1st half {first} | 2nd half {second} | "
            f"whole miss {whole} | <= {seconds:.2f} s/run"
        )
        print(f"{'':28s} tuned on the first half: {row['params']}")
    for capacity, figures in report["hindsight"].items():
        print(
            f"retention in hindsight at {capacity}: {figures['averaged']:.4f} "
            "with the capacity met on average, "
            f"{figures['hard']:.4f} in a cache of exactly {capacity} blocks; with no size limit "
            f"they hold {figures['held']['mean']:,.0f} blocks on average, "
            f"{figures['held']['p90']:,} at the 90th percentile, {figures['held']['max']:,} at most"
        )
    for capacity, miss in report["most_used"].items():
        print(f"the {capacity} most used blocks, held from their first use: miss ratio {miss:.4f}")
    for capacity, figures in report["optgen"].items():
        shares = "  ".join(f"{uses}: {share:.2f}" for uses, share in figures["kept_share_by_uses"].items())
        print(
            f"OPTgen at {capacity}: {figures['kept']:,.0f} reuses labelled kept "
            f"(Belady hits {figures['belady_hits']:,}); kept share by use count {shares}"
        )
    for name, figures in report["admission"].items():
        print(f"admission, {name}: " + "  ".join(f"{k}: {v:+.1%}" for k, v in figures.items()))


def main() -> None:
    parser = BenchParser(__doc__.splitlines()[0])
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--capacities", default="1000,4000", help="capacities tuned and tested (blocks)")
    parser.add_argument("--extra", default="16000", help="further capacities for the whole trace only")
    parser.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        sys.exit(f"no trace at {args.trace} (set --trace or LMCACHE_TIERS_REPLAY_TRACE)")
    try:
        capacities = [int(v) for v in args.capacities.split(",") if v]
        extra = [int(v) for v in args.extra.split(",") if v]
    except ValueError:
        sys.exit("--capacities and --extra are comma-separated block counts")
    if not capacities or min([*capacities, *extra]) < 1:
        sys.exit("capacities must be at least one block")
    study = Study(read_trace(args.trace))
    rows = tune_and_test(study, capacities, extra)
    hindsight = {}
    for capacity in capacities:
        averaged, keep = hindsight_keep_times(study.parts["whole"], capacity)
        hindsight[capacity] = {
            "averaged": averaged,
            "hard": expiry_cache(study.parts["whole"], capacity, keep),
            "held": keep_time_occupancy(study.parts["whole"], keep),
        }
    report = {
        "trace": args.trace,
        "baselines": {
            part: {c: study.base(part, c) for c in (capacities if part != "whole" else [*capacities, *extra])}
            for part in study.parts
        },
        "designs": rows,
        "hindsight": hindsight,
        "most_used": {c: most_used_held(study.parts["whole"], c) for c in [*capacities, *extra]},
        "admission": admission(study, capacities),
        "optgen": {capacity: optgen_calibration(study, capacity) for capacity in capacities},
    }
    show(report, capacities, extra)
    if args.json:
        print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
