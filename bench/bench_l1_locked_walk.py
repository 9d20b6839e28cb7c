"""Thread CPU of a write into a full L1 whose LRU front is read-locked.

An L1 of one-block objects is filled with ``--locked`` objects read-locked, written first
(the LRU front), then ``--unlocked`` ones; each write then evicts its room through the L1
eviction controller, as a store that found L1 full does (``evict_now``), and reserves and
commits ``--batch`` new objects.  The figure is the median thread CPU (``time.thread_time``)
per write over ``--writes`` writes after the first (the first walks past every locked key
in any case), next to the same write with nothing locked in the same run; the limit is
twice that figure.  Each count runs three times: with no read lock ending between
writes; with a lookup's lock taken and released before each (``/churn``, a busy server);
and with half the locked objects released at once after the first write, then one more
before each write (``/release``: each write puts one key back into the policy's walks
while thousands put back wait to be evicted, and evicts the oldest of them).  Without
set-aside keys every write walked past every locked key (about 0.5 us each, under the L1
lock); with them, a check of every key set aside whenever any lock had ended (``/churn``)
and a rebuild of LRU's keys put back on every put_back (``/release``) still cost
O(locked) per write.

``--old-tree DIR`` also runs the same measurement on another checkout (a worktree of an
older commit: its ``core/src`` and its eviction plugins' ``src`` first on the path), in
alternation with this one, ``--repeat`` times each, and prints both side by side.
``--policy`` names the eviction policy L1 uses (``LRU`` by default; ``ARC``, ``S3FIFO``,
``PREFIX_LFU``), built from the installed registry with its config's defaults.

    python bench/bench_l1_locked_walk.py [--locked 10000,100000] [--policy ARC] [--old-tree /tmp/wt-old]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_args import BenchParser, at_least_one

ALIGN = 512
HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
#: the eviction policy measured (``--policy``)
POLICY = "LRU"


def make_policy(name: str) -> Any:
    """The eviction policy ``name`` as a server builds it: from the installed registry, with
    its config's defaults."""
    from lmcache_tiers.plugins import load_registry
    from lmcache_tiers.registry import Kind

    component = load_registry().get(Kind.EVICTION_POLICY, name)
    return component.create(component.config())


#: the ways read locks end between writes (see the module docstring)
MODES = ("", "/churn", "/release")


def measure(locked: int, unlocked: int, writes: int, batch: int, mode: str) -> float:
    """Median thread CPU seconds per write after the first (see the module docstring);
    whatever ``mode`` does between writes is untimed."""
    import random

    from lmcache_tiers.controllers.l1_eviction import L1EvictionController
    from lmcache_tiers.controllers.stats import EngineStats
    from lmcache_tiers.keys import ObjectKey
    from lmcache_tiers.l1 import L1Manager

    def keys(start: int, count: int) -> list[ObjectKey]:
        return [ObjectKey("bench", 0, index.to_bytes(8, "big")) for index in range(start, start + count)]

    total = locked + unlocked
    l1 = L1Manager(total * ALIGN, align=ALIGN, prefault=False)
    controller = L1EvictionController(
        l1, make_policy(POLICY), trigger_watermark=0.99, eviction_ratio=0.1, stats=EngineStats(0)
    )
    try:
        front, rest = keys(0, locked), keys(locked, unlocked)
        l1.reserve_write(front + rest, [ALIGN] * total)
        if front:
            l1.finish_write_and_reserve_read(front)
        l1.finish_write(rest)
        samples: list[float] = []
        next_key = total
        releasing: list[ObjectKey] = []
        if mode == "/release" and front:
            # A first write sets the locked front aside; then half of it is released, in
            # no order, and comes back into the walks at the next write (untimed: sample 0).
            controller.evict_now(batch * ALIGN)
            l1.reserve_write(keys(next_key, batch), [ALIGN] * batch)
            l1.finish_write(keys(next_key, batch))
            next_key += batch
            releasing = list(front)
            random.Random(len(front)).shuffle(releasing)
            half, releasing = releasing[: len(front) // 2], releasing[len(front) // 2 :]
            l1.finish_read(half)
        for _ in range(writes + 1):
            new = keys(next_key, batch)
            if mode == "/churn":  # the newest object, locked and released as by a lookup
                newest = keys(next_key - 1, 1)
                l1.reserve_read(newest)
                l1.finish_read(newest)
            elif releasing:
                l1.finish_read([releasing.pop()])
            next_key += batch
            started = time.thread_time()
            controller.evict_now(batch * ALIGN)
            l1.reserve_write(new, [ALIGN] * batch)
            l1.finish_write(new)
            samples.append(time.thread_time() - started)
        return statistics.median(samples[1:])
    finally:
        controller.finish()
        l1.close()


def run_tree(tree: Path, args: list[str]) -> dict[str, float]:
    """This script's measurements with ``tree``'s sources first on the path."""
    plugins = [str(src) for src in sorted(tree.glob("plugins/eviction-*/src"))]
    path = [str(tree / "core" / "src"), *plugins, str(HERE.parent)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    out = subprocess.run(
        [sys.executable, str(HERE), "--json", *args], env=env, check=True, capture_output=True, text=True
    )
    return {key: float(value) for key, value in json.loads(out.stdout).items()}


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--locked", default="10000,100000", help="read-locked object counts, comma-separated")
    parser.add_argument("--unlocked", type=at_least_one, default=4000, help="unlocked objects behind them")
    parser.add_argument("--writes", type=at_least_one, default=200, help="writes measured per count")
    parser.add_argument("--batch", type=at_least_one, default=1, help="new objects per write")
    parser.add_argument("--policy", default="LRU", help="the eviction policy L1 uses")
    parser.add_argument("--old-tree", help="another checkout to measure in alternation with this one")
    parser.add_argument("--repeat", type=at_least_one, default=3, help="alternating runs per tree")
    parser.add_argument("--json", action="store_true", help="print this tree's figures as JSON")
    options = parser.parse_args()
    global POLICY
    POLICY = options.policy
    counts = [0, *(int(count) for count in options.locked.split(","))]
    common = [f"--locked={options.locked}", f"--unlocked={options.unlocked}"]
    common += [f"--writes={options.writes}", f"--batch={options.batch}", f"--policy={options.policy}"]
    if options.json:
        figures = {
            f"{count}{mode}": measure(count, options.unlocked, options.writes, options.batch, mode)
            for mode in MODES
            for count in counts
        }
        print(json.dumps(figures))
        return
    trees = {"this": REPO} | ({"old": Path(options.old_tree)} if options.old_tree else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(options.repeat):
        for name, tree in trees.items():  # alternating, so a noisy moment hits both
            runs[name].append(run_tree(tree, common))
    heading = f"thread CPU per write of {options.batch} object(s), median of {options.writes} writes"
    print(f"{options.policy}: {heading}")
    print(f"{'locked':>14} " + " ".join(f"{name + ' ms':>10}" for name in trees) + f" {'limit ms':>10}")
    for mode in MODES:
        baseline = statistics.median(run[f"0{mode}"] for run in runs["this"])
        for count in counts:
            label = f"{count}{mode}"
            medians = {name: statistics.median(run[label] for run in runs[name]) for name in trees}
            row = " ".join(f"{medians[name] * 1e3:10.3f}" for name in trees)
            verdict = "" if count == 0 else ("  ok" if medians["this"] <= 2 * baseline else "  OVER")
            limit = f"{2 * baseline * 1e3:10.3f}" if count else f"{'':>10}"
            print(f"{label:>14} {row} {limit}{verdict}")


if __name__ == "__main__":
    main()
