"""Store and load throughput of the raw_block and dax adapters next to the same bytes
moved by plain system calls or plain copies, in the same run.

For each case (default 256 x 1 MiB and 64 x 16 MiB), from the same page-aligned,
pre-faulted buffers (as L1 extents are):

* ``raw_block`` -- through the adapter's non-blocking interface, one batch, into a
  preallocated file (``--dir``, default a temporary directory) with ``O_DIRECT`` unless
  ``--buffered``; next to ``pwrite``/``preadv`` of the same bytes into another file of
  the same size, opened the same way, by one thread and by as many threads as the
  adapter's workers (``num_store_workers`` / ``num_load_workers``);
* ``dax`` -- through the adapter, one batch, into a file in /dev/shm mapped shared; next
  to a memcpy (numpy, GIL released) of the same bytes into and out of another mapping,
  by one thread and by as many as the adapter's workers.

The adapters also checksum every object (XXH3-128: computed on store, verified on load)
and write a header per slot (a load is timed alone: the lookup that pins its keys runs
untimed before it, as the baselines ask nothing first); the plain baselines move bytes
only, so one more baseline adds core's record checksum of every object to the moves (by
the adapter's worker counts): the figure a verified store or load could reach here.
Methods run interleaved, round by round; each figure is the median of ``--repeat`` rounds, and each
ratio is the median of per-round ratios to the fastest plain baseline (``/raw``), to the
one-thread plain baseline (``/x1``; the target is >= 0.8) and to the checksumming one
(``/+xxh3``).  ``--store-workers`` / ``--load-workers`` replace the adapters' own worker
counts (the baselines follow them).

    python bench/bench_block.py [--dir /mnt/nvme] [--cases 256x1,64x16] [--repeat 5]
        [--store-workers N] [--load-workers N] [--buffered] [--json]
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from bench_args import BenchParser, at_least_one
from cases import Case, check_whole, parse_cases
from lmcache_plugin_dax import DaxConfig
from lmcache_plugin_dax.backend import DaxBackend
from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import RawBlockBackend

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.l2.record import checksum
from lmcache_tiers.testing.blocking import BlockingAdapterClient

MIB = 1 << 20
GB = 1e9
HEADER = 4096


@dataclass
class Figures:
    store: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)


def populated(size: int) -> mmap.mmap:
    """Anonymous memory, faulted in once (first touches are slow on this kind of host)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE)


def slices(buffer: memoryview, case: Case) -> list[memoryview]:
    return [buffer[i * case.size : (i + 1) * case.size] for i in range(case.count)]


def timed(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def in_threads(threads: int, work: Callable[[int], None], count: int) -> None:
    if threads == 1:
        for index in range(count):
            work(index)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(count)))


class Baseline:
    """Moves the same bytes with plain calls: ``write(i)`` / ``read(i)``."""

    def __init__(self, name: str, write: Callable[[int], None], read: Callable[[int], None]) -> None:
        self.name, self.write, self.read = name, write, read


def file_baseline(path: str, case: Case, sources: list[memoryview], targets: list[memoryview], direct: bool):
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    os.posix_fallocate(fd, 0, case.total)

    def write(index: int) -> None:
        check_whole("pwritev", index, os.pwritev(fd, [sources[index]], index * case.size), case.size)

    def read(index: int) -> None:
        check_whole("preadv", index, os.preadv(fd, [targets[index]], index * case.size), case.size)

    return fd, write, read


def mapping_baseline(path: str, case: Case, sources: list[memoryview], targets: list[memoryview]):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, case.total)
    array = np.frombuffer(mmap.mmap(fd, case.total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), np.uint8)

    def write(index: int) -> None:
        np.copyto(array[index * case.size : (index + 1) * case.size], np.frombuffer(sources[index], np.uint8))

    def read(index: int) -> None:
        np.copyto(np.frombuffer(targets[index], np.uint8), array[index * case.size : (index + 1) * case.size])

    return fd, write, read


def open_adapter(factory: Any, config: Any) -> L2Adapter:
    return create_adapter(
        factory, config, AdapterContext(index=0, name=f"0:{factory.__name__}", config=config)
    )


def adapter_round(
    adapter: L2Adapter, keys: Sequence[ObjectKey], sources: list[memoryview], targets: list[memoryview]
) -> tuple[float, float]:
    client = BlockingAdapterClient(adapter, timeout=600)
    start = time.perf_counter()
    stored = client.store(keys, sources)
    store_s = time.perf_counter() - start
    every = [True] * len(keys)
    if stored != every:
        raise SystemExit(f"{adapter.name}: {stored.count(False)} stores failed: {adapter.stats()}")
    found = client.lookup_and_lock(keys)  # pins the keys; untimed, the baselines need none
    start = time.perf_counter()
    loaded = client.load(keys, targets)
    load_s = time.perf_counter() - start
    adapter.unlock(keys)
    if found.found != every or loaded != every:
        raise SystemExit(f"{adapter.name}: {loaded.count(False)} loads failed: {adapter.stats()}")
    if adapter.delete(keys) != every:
        raise SystemExit(f"{adapter.name}: deletes failed: {adapter.stats()}")
    return store_s, load_s


def worker_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The adapter config fields ``--store-workers`` / ``--load-workers`` set."""
    fields = {"num_store_workers": args.store_workers, "num_load_workers": args.load_workers}
    return {name: value for name, value in fields.items() if value is not None}


def run_case(case: Case, kind: str, args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    source_map, target_map = populated(case.total), populated(case.total)
    rng = np.random.default_rng(case.count)
    np.frombuffer(source_map, np.uint8)[:] = rng.integers(0, 256, case.total, dtype=np.uint8)
    sources, targets = slices(memoryview(source_map), case), slices(memoryview(target_map), case)
    keys = [ObjectKey("bench-model", 0, i.to_bytes(8, "big")) for i in range(case.count)]
    cleanup: list[Callable[[], None]] = []
    # The adapter is closed and the baseline file descriptor too also when the other cannot
    # be set up (O_DIRECT refused by --dir's filesystem, say).
    try:
        if kind == "raw_block":
            config = RawBlockConfig(
                device_path=str(Path(root) / "raw_block.img"),
                slot_bytes=case.size + HEADER,
                capacity_bytes=(case.count + 8) * (case.size + HEADER) + (8 << 20),
                use_odirect=not args.buffered,
                **worker_overrides(args),
            )
            adapter = open_adapter(RawBlockBackend, config)
            cleanup.append(adapter.close)
            workers = (config.num_store_workers, config.num_load_workers)
            fd, write, read = file_baseline(
                str(Path(root) / "baseline.img"), case, sources, targets, not args.buffered
            )
            cleanup.append(lambda: os.close(fd))
            what = "pwrite/preadv" + ("" if args.buffered else " O_DIRECT")
        else:
            config = DaxConfig(
                device_path=str(Path(root) / "dax.img"),
                max_dax_size_gb=((case.count + 8) * (case.size + HEADER) + (8 << 20)) / (1 << 30),
                slot_bytes=case.size,
                **worker_overrides(args),
            )
            adapter = open_adapter(DaxBackend, config)
            cleanup.append(adapter.close)
            workers = (config.store_workers, config.load_workers)
            # The mapping stays until the copy functions are collected with this frame.
            fd, write, read = mapping_baseline(str(Path(root) / "baseline.img"), case, sources, targets)
            cleanup.append(lambda: os.close(fd))
            what = "memcpy"
        return measure(case, kind, what, adapter, keys, sources, targets, write, read, workers, args.repeat)
    finally:
        for action in reversed(cleanup):
            action()
        for view in sources + targets:
            view.release()


def with_checksum(
    move: Callable[[int], None], buffers: list[memoryview], before: bool
) -> Callable[[int], None]:
    """``move`` plus core's record checksum of the object (before a write, after a read)."""

    def step(index: int) -> None:
        if before:
            checksum(buffers[index])
        move(index)
        if not before:
            checksum(buffers[index])

    return step


def measure(
    case: Case,
    kind: str,
    what: str,
    adapter: L2Adapter,
    keys: list[ObjectKey],
    sources: list[memoryview],
    targets: list[memoryview],
    write: Callable[[int], None],
    read: Callable[[int], None],
    workers: tuple[int, int],
    repeat: int,
) -> list[dict[str, Any]]:
    """Median GB/s of every method, and the adapter's median per-round ratios to the
    fastest plain baseline, to the one-thread plain baseline and to the fastest baseline
    that also checksums."""
    methods: dict[str, tuple[Callable[[], Any], Callable[[], Any], bool]] = {}
    for threads in sorted({1, *workers}):
        methods[f"{what} x{threads}"] = (
            lambda t=threads: in_threads(t, write, case.count),
            lambda t=threads: in_threads(t, read, case.count),
            False,
        )
    checked_write = with_checksum(write, sources, before=True)
    checked_read = with_checksum(read, targets, before=False)
    store_threads, load_threads = workers
    methods[f"{what} + xxh3 x{store_threads}/{load_threads}"] = (
        lambda: in_threads(store_threads, checked_write, case.count),
        lambda: in_threads(load_threads, checked_read, case.count),
        True,
    )
    adapter_round(adapter, keys, sources, targets)  # warm-up: first writes of fresh extents
    for store, _load, _checked in methods.values():
        store()
    figures: dict[str, Figures] = {}
    ratios: dict[str, list[float]] = {
        name: [] for name in ("store", "load", "store_1t", "load_1t", "store_ck", "load_ck")
    }
    for _ in range(repeat):
        seconds = {name: (timed(store), timed(load)) for name, (store, load, _c) in methods.items()}
        seconds[kind] = adapter_round(adapter, keys, sources, targets)
        for name, (store_s, load_s) in seconds.items():
            entry = figures.setdefault(name, Figures())
            entry.store.append(case.total / store_s / GB)
            entry.load.append(case.total / load_s / GB)
        for suffix, checked in (("", False), ("_ck", True)):
            chosen = [seconds[name] for name, (_s, _l, c) in methods.items() if c == checked]
            ratios["store" + suffix].append(min(s for s, _ in chosen) / seconds[kind][0])
            ratios["load" + suffix].append(min(lo for _, lo in chosen) / seconds[kind][1])
        one_store, one_load = seconds[f"{what} x1"]
        ratios["store_1t"].append(one_store / seconds[kind][0])
        ratios["load_1t"].append(one_load / seconds[kind][1])
    rows = []
    for name, entry in figures.items():
        row: dict[str, Any] = {
            "adapter": kind,
            "case": case.label,
            "method": name,
            "store_gbps": statistics.median(entry.store),
            "load_gbps": statistics.median(entry.load),
        }
        if name == kind:
            row.update({f"{key}_ratio": statistics.median(values) for key, values in ratios.items()})
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    names = ("store", "load", "store_1t", "load_1t", "store_ck", "load_ck")
    heads = ("store/raw", "load/raw", "store/x1", "load/x1", "store/+xxh3", "load/+xxh3")
    print(
        f"{'adapter':10} {'case':13} {'method':34} {'store GB/s':>10} {'load GB/s':>10} "
        + " ".join(f"{h:>11}" for h in heads)
    )
    for row in rows:
        ratios = " ".join(f"{row[n + '_ratio']:11.2f}" if n + "_ratio" in row else " " * 11 for n in names)
        print(
            f"{row['adapter']:10} {row['case']:13} {row['method']:34} {row['store_gbps']:10.2f} "
            f"{row['load_gbps']:10.2f} {ratios}"
        )


ADAPTERS = ("raw_block", "dax")


def adapter_list(text: str) -> list[str]:
    """``--adapters``: names of ADAPTERS only (any other name would be measured as dax)."""
    names = text.split(",")
    unknown = [name for name in names if name not in ADAPTERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown adapter {unknown[0]!r}; choose from {', '.join(ADAPTERS)}")
    return names


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--dir", help="directory for raw_block's device file (default: a temp dir)")
    parser.add_argument("--cases", type=parse_cases, default="256x1,64x16", help="COUNTxMIB,...")
    parser.add_argument("--adapters", type=adapter_list, default="raw_block,dax", help="raw_block,dax")
    parser.add_argument("--repeat", type=at_least_one, default=5)
    parser.add_argument("--store-workers", type=at_least_one, help="num_store_workers of the adapters")
    parser.add_argument("--load-workers", type=at_least_one, help="num_load_workers of the adapters")
    parser.add_argument("--buffered", action="store_true", help="raw_block and its baseline without O_DIRECT")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for kind in args.adapters:
        for case in args.cases:
            root = tempfile.mkdtemp(
                prefix="bench-block-", dir=args.dir if kind == "raw_block" else "/dev/shm"
            )
            try:
                rows.extend(run_case(case, kind, args, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
