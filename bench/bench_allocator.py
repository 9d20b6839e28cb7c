"""Fragmentation and speed of the L1 extent allocator under mixed-size churn.

Three phases on one allocator, with objects of mixed sizes allocated in batches:

1. steady churn: allocate batches while usage is under ``--target`` and free random
   objects above it, until the layout reaches a steady state; fragmentation
   (1 - largest free extent / free bytes) is sampled after a warm-up;
2. fill: from that fragmented layout, allocate only, until the first batch does not fit:
   the utilisation at the first failure is how much of the arena is usable in practice;
3. pressure: keep churning at the limit; when a batch does not fit, free random objects
   until it does (what L1 eviction does); the utilisation at every failure is recorded.

Speed is extents allocated or freed per second, timed inside the allocator calls, next to
Python dict insert+delete per second as this machine's reference. The same run is repeated
with an address-ordered first-fit baseline unless ``--no-baseline``.

    python bench/bench_allocator.py --capacity-gb 1 --ops 100000 [--dist models]
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench_args import BenchParser, at_least_one

from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.replay.run import percentile

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


class FirstFitAllocator(ExtentAllocator):
    """Baseline: the lowest-addressed free extent that fits (a linear scan by address)."""

    def _fit(self, need: int) -> tuple[int, int] | None:
        for offset, length in self.free_extents():
            if length >= need:
                self._remove_sized(offset, length)
                return offset, length
        return None


def size_sampler(kind: str, min_size: int, max_size: int, rng: random.Random) -> Callable[[], int]:
    low, high = math.log(min_size), math.log(max_size)
    if kind == "loguniform":
        return lambda: int(math.exp(rng.uniform(low, high)))
    if kind == "uniform":
        return lambda: rng.randint(min_size, max_size)
    # "models": KV chunks of a few model shapes (90%), plus odd sizes.
    shapes = (64 * KIB, 256 * KIB, MIB, 2 * MIB + 512 * KIB, 4 * MIB, 12 * MIB)
    fixed = [size for size in shapes if min_size <= size <= max_size]
    return lambda: rng.choice(fixed) if rng.random() < 0.9 else int(math.exp(rng.uniform(low, high)))


@dataclass
class Run:
    """One allocator driven through the three phases, with its figures."""

    allocator: ExtentAllocator
    sampler: Callable[[], int]
    rng: random.Random
    max_batch: int
    live: list[int] = field(default_factory=list)
    extent_ops: int = 0
    seconds: float = 0.0
    steady_fragmentation: list[float] = field(default_factory=list)
    steady_utilisation: list[float] = field(default_factory=list)
    free_extents_max: int = 0
    first_failure_utilisation: float = 0.0
    first_failure_fragmentation: float = 0.0
    pressure_failure_utilisation: list[float] = field(default_factory=list)

    def usage(self) -> float:
        return self.allocator.allocated_bytes / self.allocator.capacity

    def batch(self) -> list[int]:
        return [self.sampler() for _ in range(self.rng.randint(1, self.max_batch))]

    def allocate(self, sizes: list[int]) -> bool:
        start = time.perf_counter()
        offsets = self.allocator.allocate_many(sizes)
        self.seconds += time.perf_counter() - start
        if offsets is None:
            return False
        self.extent_ops += len(offsets)
        self.live.extend(offsets)
        return True

    def free_random(self) -> None:
        index = self.rng.randrange(len(self.live))
        self.live[index], self.live[-1] = self.live[-1], self.live[index]
        offset = self.live.pop()
        start = time.perf_counter()
        self.allocator.free_many([offset])
        self.seconds += time.perf_counter() - start
        self.extent_ops += 1

    def steady_churn(self, ops: int, target: float, sample_every: int) -> None:
        warmup = ops // 4
        for step in range(ops):
            if self.usage() < target:
                if not self.allocate(self.batch()) and self.live:
                    self.free_random()
            elif self.live:
                self.free_random()
            if step >= warmup and step % sample_every == 0:
                self.steady_fragmentation.append(self.allocator.fragmentation())
                self.steady_utilisation.append(self.usage())
                self.free_extents_max = max(self.free_extents_max, self.allocator.free_extent_count)

    def fill_to_first_failure(self) -> None:
        while self.allocate(self.batch()):
            pass
        self.first_failure_utilisation = self.usage()
        self.first_failure_fragmentation = self.allocator.fragmentation()

    def pressure(self, ops: int) -> None:
        for _ in range(ops):
            if self.live and self.rng.random() < 0.5:  # nothing to free in an emptied arena
                self.free_random()
                continue
            sizes = self.batch()
            while not self.allocate(sizes):
                self.pressure_failure_utilisation.append(self.usage())
                if not self.live:
                    raise SystemExit(f"a batch of {sum(sizes)} bytes does not fit in an empty arena")
                self.free_random()


def report(name: str, run: Run, target: float) -> None:
    frag = run.steady_fragmentation
    failures = run.pressure_failure_utilisation
    print(f"\n[{name}]")
    print(
        f"  steady churn at {target:.0%}:   utilisation mean {statistics.fmean(run.steady_utilisation):6.1%}"
        f"   fragmentation mean {statistics.fmean(frag):.3f}  p50 {percentile(frag, 0.5):.3f}"
        f"  p95 {percentile(frag, 0.95):.3f}  max {max(frag):.3f}   free extents max {run.free_extents_max}"
    )
    print(
        f"  fill to first failure:    utilisation {run.first_failure_utilisation:6.1%}"
        f"   fragmentation {run.first_failure_fragmentation:.3f}"
    )
    if failures:
        print(
            f"  pressure (evict on fail): {len(failures)} failures at utilisation mean "
            f"{statistics.fmean(failures):6.1%}  p5 {percentile(failures, 0.05):6.1%}"
        )
    print(
        f"  allocator speed:          {run.extent_ops / run.seconds:,.0f} extent ops/s "
        f"({run.extent_ops:,} extents in {run.seconds:.2f} s inside the allocator)"
    )


def steady_pairs_per_second(capacity: int, align: int, n: int, size: int) -> float:
    """Single allocate+free on a half-full, fragmented arena: the per-call overhead."""
    allocator = ExtentAllocator(capacity, align)
    rng = random.Random(1)
    offsets = allocator.allocate_many([rng.randint(align, 64 * align) for _ in range(2000)]) or []
    allocator.free_many(offsets[::2])
    start = time.perf_counter()
    for _ in range(n):
        got = allocator.allocate_many([size])
        if got is None:
            raise SystemExit("steady-pair benchmark: the arena is too small")
        allocator.free_many(got)
    return 2 * n / (time.perf_counter() - start)


def dict_ops_per_second(n: int = 200_000) -> float:
    table: dict[int, int] = {}
    start = time.perf_counter()
    for index in range(n):
        table[index] = index
    for index in range(n):
        del table[index]
    return 2 * n / (time.perf_counter() - start)


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--capacity-gb", type=float, default=1.0)
    parser.add_argument("--align", type=int, default=4096)
    parser.add_argument("--min-size-kib", type=int, default=4)
    parser.add_argument("--max-size-mib", type=float, default=16)
    parser.add_argument("--dist", choices=["loguniform", "uniform", "models"], default="loguniform")
    parser.add_argument(
        "--ops", type=at_least_one, default=100_000, help="steps of steady churn, and of pressure"
    )
    parser.add_argument("--target", type=float, default=0.8, help="usage the steady churn hovers at")
    parser.add_argument("--max-batch", type=at_least_one, default=8, help="objects per allocate_many, 1..N")
    parser.add_argument("--sample-every", type=at_least_one, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the first-fit comparison")
    parser.add_argument(
        "--prefault-gb", type=float, default=0.0, help="also time creating a pre-faulted shm arena this large"
    )
    args = parser.parse_args()

    capacity = int(args.capacity_gb * GIB)
    min_size, max_size = args.min_size_kib * KIB, int(args.max_size_mib * MIB)
    print(
        f"capacity {capacity / GIB:.2f} GiB, align {args.align}, sizes {args.dist} "
        f"{min_size // KIB} KiB..{max_size / MIB:g} MiB, batches of 1..{args.max_batch}, "
        f"{args.ops} steps per phase, seed {args.seed}"
    )
    kinds: list[tuple[str, type[ExtentAllocator]]] = [("best fit: ExtentAllocator", ExtentAllocator)]
    if not args.no_baseline:
        kinds.append(("address-ordered first fit: baseline", FirstFitAllocator))
    for name, cls in kinds:
        rng = random.Random(args.seed)  # the same size and choice sequence for every allocator
        run = Run(
            cls(capacity, args.align), size_sampler(args.dist, min_size, max_size, rng), rng, args.max_batch
        )
        run.steady_churn(args.ops, args.target, args.sample_every)
        run.fill_to_first_failure()
        run.pressure(args.ops)
        report(name, run, args.target)

    print(
        f"\nsingle allocate+free, fragmented arena: "
        f"{steady_pairs_per_second(capacity, args.align, 100_000, 256 * KIB):,.0f} calls/s"
    )
    print(f"reference, Python dict insert+delete:   {dict_ops_per_second():,.0f} ops/s")

    if args.prefault_gb > 0:
        from lmcache_tiers.l1.arena import L1Arena

        size = int(args.prefault_gb * GIB)
        start = time.perf_counter()
        arena = L1Arena(size, prefault=True)
        elapsed = time.perf_counter() - start
        arena.close()
        print(
            f"pre-faulted {size / GIB:.2f} GiB shm arena in {elapsed:.2f} s "
            f"({size / GIB / elapsed:.2f} GiB/s)"
        )


if __name__ == "__main__":
    main()
