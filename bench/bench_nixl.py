"""Store and load throughput of the NIXL adapters next to plain os.pwrite / os.preadv.

For each case (default 256 x 1 MiB and 64 x 16 MiB) the same bytes, from the same
page-aligned buffers, are written and read back by:

* ``pwrite new``   -- one new file per object: open, ``os.pwrite``, close (what
                      nixl_store_dynamic does, minus header, checksum and rename);
* ``+ checksum``   -- the same plus core's record checksum of every object (computed
                      before the write, verified after the read), to show its cost;
* ``+ checksum thread`` -- the same checksums on a second thread, overlapping the
                      writes and reads (xxhash releases the GIL): the best a verified
                      load can do here, and only when a second core is free;
* ``preadv 2 threads`` -- plain I/O with the loads spread over two threads, no checksum:
                      a probe of how much of a second core this run had (about 1.0x of
                      ``pwrite new files`` means the other core was taken by other jobs, so
                      the limit of a verified load is then ``+ record checksum``, one core);
* ``+ checksum 2 threads`` -- the same two-thread loads, each object checksummed right
                      after its read on the thread that read it (stores as ``+ record
                      checksum``): the most a verified load gets out of two cores, as the
                      copy and the hash are both CPU work (about 0.8x of ``preadv 2 threads``
                      on this project's 2-core machines);
* ``nixl_store_dynamic`` -- through the adapter's non-blocking interface, one batch;
* ``pwrite reuse`` -- ``os.pwrite`` into files opened once (what nixl_store's slots are);
* ``nixl_store``   -- through the adapter, one batch, into its preallocated slots;

and reads with ``os.preadv`` / adapter loads.  Methods run interleaved, round by round,
in the order above in even rounds and reversed in odd ones, so that no method always
runs on what the same other one left behind (page cache, dirty pages, the CPU's clock)
and each baseline runs both before and after the methods compared with it (an even
``--repeat`` gives both orders as many rounds).
Every figure is the median of ``--repeat`` rounds, printed as GB/s with its ratio to the
matching plain-I/O baseline (the target is >= 0.8); a ratio is the median of per-round
ratios, which cancels most of a shared machine's drift.  Loads are served from the page
cache unless ``--drop-caches`` (root only) empties it before every read phase, for the
baselines and adapters alike.
Stores write new files each round (objects deleted in between) but are not fsynced,
so they too measure the kernel's write path rather than the device.  Every method's files
are in the same state when loaded (written, then ``os.sync``, all in the page cache): who
wrote them (NIXL or ``os.pwrite``) and whether they were synced made no measurable
difference to ``preadv`` of them.  The load average is printed with each case, since the
1 MiB verified load depends on a second core being free.

    python bench/bench_nixl.py [--dir /mnt/nvme/bench] [--cases 256x1,64x16] [--repeat 5]
        [--direct-io] [--drop-caches] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import numpy as np
from bench_args import BenchParser, at_least_one
from cases import Case, parse_cases
from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig
from lmcache_plugin_nixl.dynamic import NixlDynamicBackend
from lmcache_plugin_nixl.store import NixlStoreBackend
from rounds import round_order

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.l2.record import checksum
from lmcache_tiers.l2.workers import BatchWorkers
from lmcache_tiers.testing.blocking import BlockingAdapterClient

MIB = 1 << 20
GB = 1e9


@dataclass
class Result:
    case: str
    method: str
    store_gbps: float
    load_gbps: float
    baseline: str = ""
    store_ratio: float | None = None
    load_ratio: float | None = None
    base_store_gbps: float | None = None
    base_load_gbps: float | None = None
    runs: dict[str, list[float]] = field(default_factory=dict)
    load_average: tuple[float, float] = (0.0, 0.0)  # 1-minute load average: before, after
    #: nixl_store_dynamic's loads against each two-thread plain load (issue 16's measure)
    two_thread_load_ratios: dict[str, float] = field(default_factory=dict)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as handle:
        handle.write("3\n")


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


class Buffers:
    """Source and destination objects in one page-aligned arena (like L1)."""

    def __init__(self, case: Case) -> None:
        self._map = mmap.mmap(-1, 2 * case.total)
        self.view = memoryview(self._map)
        rng = np.random.default_rng(0)
        source_bytes = np.frombuffer(self._map, dtype=np.uint8)[: case.total]
        source_bytes[:] = rng.integers(0, 256, case.total, dtype=np.uint8)
        self.sources = [self.view[i * case.size : (i + 1) * case.size] for i in range(case.count)]
        self.targets = [self.view[case.total + i * case.size :][: case.size] for i in range(case.count)]

    def clear_targets(self) -> None:
        for target in self.targets:
            target[:] = bytes(len(target))

    def verify(self) -> None:
        for source, target in zip(self.sources, self.targets, strict=True):
            if source != target:
                raise SystemExit("loaded bytes differ from the stored bytes")


def pwrite_new_files(
    directory: str,
    buffers: Buffers,
    *,
    prefix: str = "plain",
    with_checksum: bool = False,
    helper: ThreadPoolExecutor | None = None,
    extra_flags: int = 0,
    readers: BatchWorkers | None = None,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """One new file per object; ``with_checksum`` adds core's record checksum each way,
    inline or, given a ``helper``, on that thread while the objects are moved.  Given
    ``readers``, the loads are spread over those threads, each object checksummed (with
    ``with_checksum``) by the thread that read it."""
    paths = [os.path.join(directory, f"{prefix}-{i}.bin") for i in range(len(buffers.sources))]
    overlapped = helper is not None

    def store() -> None:
        sums = helper.map(checksum, buffers.sources) if helper is not None else None
        for path, source in zip(paths, buffers.sources, strict=True):
            if with_checksum and not overlapped:
                checksum(source)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | extra_flags, 0o644)
            os.pwrite(fd, source, 0)
            os.close(fd)
        if sums is not None:
            list(sums)

    def read_one(path: str, target: memoryview) -> None:
        fd = os.open(path, os.O_RDONLY | extra_flags)
        os.preadv(fd, [target], 0)
        os.close(fd)
        if with_checksum:
            checksum(target)

    def load() -> None:
        if readers is not None:
            readers.map(read_one, paths, buffers.targets)
            return
        pending = []
        for path, target in zip(paths, buffers.targets, strict=True):
            fd = os.open(path, os.O_RDONLY | extra_flags)
            os.preadv(fd, [target], 0)
            os.close(fd)
            if helper is not None:
                pending.append(helper.submit(checksum, target))
            elif with_checksum:
                checksum(target)
        for future in pending:
            future.result()

    return store, load


class ReusedFiles:
    """Files opened once and rewritten in place, like a slot pool."""

    def __init__(self, directory: str, buffers: Buffers, extra_flags: int = 0) -> None:
        self.buffers = buffers
        self.fds = [
            os.open(os.path.join(directory, f"reuse-{i}.bin"), os.O_RDWR | os.O_CREAT | extra_flags, 0o644)
            for i in range(len(buffers.sources))
        ]

    def store(self) -> None:
        for fd, source in zip(self.fds, self.buffers.sources, strict=True):
            os.pwrite(fd, source, 0)

    def load(self) -> None:
        for fd, target in zip(self.fds, self.buffers.targets, strict=True):
            os.preadv(fd, [target], 0)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def adapter_actions(
    adapter: L2Adapter, keys: list[ObjectKey], buffers: Buffers
) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """Store, load and delete every key of the case through the non-blocking interface."""
    client = BlockingAdapterClient(adapter, timeout=600)

    def store() -> None:
        if client.store(keys, buffers.sources) != [True] * len(keys):
            raise SystemExit(f"{adapter.name}: store failed: {adapter.stats()}")

    def load() -> None:
        if client.load(keys, buffers.targets) != [True] * len(keys):
            raise SystemExit(f"{adapter.name}: load failed: {adapter.stats()}")

    def reset() -> None:
        adapter.delete(keys)

    return store, load, reset


@dataclass
class Method:
    """One way of storing and loading the case's objects."""

    name: str
    store: Callable[[], None]
    load: Callable[[], None]
    reset: Callable[[], None] | None = None
    baseline: str = ""
    store_times: list[float] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)


def run_round(method: Method, buffers: Buffers, drop: bool) -> None:
    if method.reset is not None:
        method.reset()
    # Dirty pages of the previous phase are written back first, so that no method pays
    # for another one's writeback.
    os.sync()
    method.store_times.append(timed(method.store))
    os.sync()
    buffers.clear_targets()
    if drop:
        drop_caches()
    method.load_times.append(timed(method.load))
    buffers.verify()


def run_case(case: Case, root: str, args: argparse.Namespace) -> list[Result]:
    buffers = Buffers(case)
    keys = [ObjectKey("bench", 0, i.to_bytes(8, "big")) for i in range(case.count)]
    direct = "true" if args.direct_io else "false"
    plain_dir = os.path.join(root, "plain")
    os.makedirs(plain_dir)
    # With --direct-io the baselines use O_DIRECT too (the buffers are page-aligned).
    flags = os.O_DIRECT if args.direct_io else 0
    helper = ThreadPoolExecutor(max_workers=1)
    readers = BatchWorkers(2, "bench-read")
    store_new, load_new = pwrite_new_files(plain_dir, buffers, extra_flags=flags)
    store_summed, load_summed = pwrite_new_files(
        plain_dir, buffers, prefix="summed", with_checksum=True, extra_flags=flags
    )
    store_threaded, load_threaded = pwrite_new_files(
        plain_dir, buffers, prefix="threaded", with_checksum=True, helper=helper, extra_flags=flags
    )

    def unlinker(prefix: str) -> Callable[[], None]:
        def unlink() -> None:
            for name in os.listdir(plain_dir):
                if name.startswith(prefix):
                    os.unlink(os.path.join(plain_dir, name))

        return unlink

    store_pair, load_pair = pwrite_new_files(
        plain_dir, buffers, prefix="pair", readers=readers, extra_flags=flags
    )
    store_pair_summed, load_pair_summed = pwrite_new_files(
        plain_dir, buffers, prefix="pairsummed", with_checksum=True, readers=readers, extra_flags=flags
    )
    reused = ReusedFiles(plain_dir, buffers, flags)
    dynamic_config = msgspec.convert(
        {
            "backend": "POSIX",
            "backend_params": {
                "file_path": os.path.join(root, "dynamic"),
                "use_direct_io": direct,
                "max_capacity_gb": str(2 * case.total / (1 << 30)),
                "shard_dirs": "true",
            },
            "persist_enabled": False,
        },
        NixlStoreDynamicConfig,
    )
    pool_config = msgspec.convert(
        {
            "backend": "POSIX",
            "backend_params": {"file_path": os.path.join(root, "pool"), "use_direct_io": direct},
            "pool_size": case.count,
        },
        NixlStoreConfig,
    )
    dynamic_context = AdapterContext(0, "0:nixl_store_dynamic", dynamic_config, l1_buffer=buffers.view)
    dynamic = create_adapter(NixlDynamicBackend, dynamic_config, dynamic_context)
    pool_context = AdapterContext(1, "1:nixl_store", pool_config, l1_buffer=buffers.view)
    pool = create_adapter(NixlStoreBackend, pool_config, pool_context)
    try:
        methods = [
            Method("pwrite new files", store_new, load_new, unlinker("plain-")),
            Method("  + record checksum", store_summed, load_summed, unlinker("summed-"), "pwrite new files"),
            Method(
                "  + checksum thread",
                store_threaded,
                load_threaded,
                unlinker("threaded-"),
                "pwrite new files",
            ),
            Method("  preadv 2 threads", store_pair, load_pair, unlinker("pair-"), "pwrite new files"),
            Method(
                "  + checksum 2 threads",
                store_pair_summed,
                load_pair_summed,
                unlinker("pairsummed-"),
                "pwrite new files",
            ),
            Method("nixl_store_dynamic", *adapter_actions(dynamic, keys, buffers), "pwrite new files"),
            Method("pwrite reused files", reused.store, reused.load),
            Method("nixl_store", *adapter_actions(pool, keys, buffers), "pwrite reused files"),
        ]
        # Rounds interleave the methods so that a machine getting slower or faster during
        # the run shifts every figure alike instead of favouring whichever ran first, and
        # every other round reverses their order (round_order says why).
        load_before = os.getloadavg()[0]
        for number in range(args.repeat):
            for method in round_order(methods, number):
                run_round(method, buffers, args.drop_caches)
    finally:
        dynamic.close()
        pool.close()
        reused.close()
        helper.shutdown()
        readers.shutdown()
    load_average = (load_before, os.getloadavg()[0])

    by_name: dict[str, Result] = {}
    for method in methods:
        result = Result(
            case.label,
            method.name,
            case.total / statistics.median(method.store_times) / GB,
            case.total / statistics.median(method.load_times) / GB,
            runs={"store_s": method.store_times, "load_s": method.load_times},
            load_average=load_average,
        )
        if method.baseline:
            # Ratios are taken round by round (baseline and adapter ran in the same round,
            # the baseline first in even rounds and last in odd ones) and then the
            # median, which cancels most of a shared machine's drift.
            base = next(m for m in methods if m.name == method.baseline)
            result.baseline = base.name
            result.base_store_gbps = case.total / statistics.median(base.store_times) / GB
            result.base_load_gbps = case.total / statistics.median(base.load_times) / GB
            result.store_ratio = statistics.median(
                b / a for a, b in zip(method.store_times, base.store_times, strict=True)
            )
            result.load_ratio = statistics.median(
                b / a for a, b in zip(method.load_times, base.load_times, strict=True)
            )
        by_name[method.name] = result
    by_name["nixl_store_dynamic"].two_thread_load_ratios = {
        other.strip(): statistics.median(
            b / a
            for a, b in zip(
                by_name["nixl_store_dynamic"].runs["load_s"], by_name[other].runs["load_s"], strict=True
            )
        )
        for other in ("  preadv 2 threads", "  + checksum 2 threads")
    }
    return list(by_name.values())


def print_table(results: list[Result]) -> None:
    # Each row shows its baseline's figure from the same rounds next to its own, then the
    # ratio (the median of per-round ratios, so not exactly the quotient of the medians).
    print(
        f"{'case':<14} {'method':<22} {'store GB/s':>10} {'(base)':>7} {'ratio':>6} "
        f"{'load GB/s':>10} {'(base)':>7} {'ratio':>6}  baseline"
    )

    def figures(gbps: float, base: float | None, ratio: float | None) -> str:
        base_text = f"({base:.2f})" if base is not None else "-"
        ratio_text = f"{ratio:.2f}" if ratio is not None else "-"
        return f"{gbps:>10.2f} {base_text:>7} {ratio_text:>6}"

    case = ""
    for r in results:
        if r.case != case:
            case = r.case
            before, after = r.load_average
            print(f"{case}: 1-minute load average {before:.2f} before, {after:.2f} after")
        store = figures(r.store_gbps, r.base_store_gbps, r.store_ratio)
        load = figures(r.load_gbps, r.base_load_gbps, r.load_ratio)
        print(f"{r.case:<14} {r.method:<22} {store} {load}  {r.baseline}")
        for other, ratio in r.two_thread_load_ratios.items():
            print(f"{'':<14} {'':<22} {'':>26} load {ratio:.2f}x of {other}")


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--dir", help="directory on the filesystem to measure (default: a temp dir)")
    parser.add_argument("--cases", type=parse_cases, default="256x1,64x16", help="COUNTxMIB,...")
    parser.add_argument("--repeat", type=at_least_one, default=5)
    parser.add_argument("--direct-io", action="store_true", help="use_direct_io true for both adapters")
    parser.add_argument(
        "--drop-caches", action="store_true", help="drop the page cache before every load (root only)"
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    if args.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("--drop-caches needs write access to /proc/sys/vm/drop_caches (root)")

    results: list[Result] = []
    for case in args.cases:
        root = tempfile.mkdtemp(prefix="bench-nixl-", dir=args.dir)
        try:
            results.extend(run_case(case, root, args))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
