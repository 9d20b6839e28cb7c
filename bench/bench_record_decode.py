"""Per-object cost of a verified record-file load, step by step, next to the system calls.

What fs and nixl_store_dynamic (buffered POSIX) do for each object of a load
(``RecordLoads.load``) is: find the path, the header's length, ``open``, one ``preadv`` of
header and payload, decode and check the header against the expected key and serde
chain, hash the payload, ``close``.  Only the system calls and the hash are the limit;
everything else is Python work per object, which on a 1 MiB object (a ~170 us copy from
the page cache) shows as a lower ratio to ``preadv``.

Parts, each printed in microseconds per object (median of ``--repeat`` rounds, 1-minute
load average with it):

* ``steps`` -- each step of one load timed alone over ``--count`` records (small payloads,
  so the bytes cost nothing): path, header length, the header check
  (``BackendContext.read_record_header``), ``decode_header`` alone, the bare system calls;
* ``loads`` -- ``RecordLoads.load`` of the same records on one thread next to bare
  ``open`` + ``preadv`` + ``close`` of the same files in the same state, the two taking
  turns round by round: the difference is the per-object work of a load beyond its
  system calls;
* ``payload`` -- ``--payload-kib`` payloads (default 1024) loaded on one thread by
  ``RecordLoads.load`` (each object's whole load, decoding included, between two copies)
  and by ``RecordLoads.load_many`` (what nixl_store_dynamic's buffered reads use: the
  Python work per object in loops before and after the copies), next to the limit,
  ``open`` + ``preadv`` + XXH3-128 + ``close`` of the same files on one thread, and that
  limit with the header check run between each copy and its hash.  A 1 MiB copy leaves
  the interpreter's code and data out of the core's caches, so Python work between two
  copies costs several times what it costs in the ``steps`` loops.  The four take turns round
  by round as well, so a shared machine's drift shifts them alike.

    python bench/bench_record_decode.py [--dir /tmp] [--count 64] [--repeat 7] [--payload-kib 1024]
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_args import BenchParser, at_least_one

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import AdapterContext, BackendContext
from lmcache_tiers.l2.files import RECORD_ALIGN, FileLayout, HeaderSizes, LocalFiles
from lmcache_tiers.l2.files.loads import RecordLoads
from lmcache_tiers.l2.record import checksum, decode_header
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.l2.workers import BatchWorkers


class Store:
    """Record files of ``count`` keys, written as fs and nixl_store_dynamic write them."""

    def __init__(self, root: str, count: int, payload_size: int) -> None:
        state = AdapterState(AdapterContext(index=0, name="0:bench", config=L2AdapterConfig()))
        self.context = BackendContext(state)
        self.files = LocalFiles(FileLayout(root, shard_dirs=True), name="0:bench", count=self.context.count)
        self.sizes = HeaderSizes(
            lambda key, payload: self.context.record_header(key, payload, align=RECORD_ALIGN)
        )
        self.loads = RecordLoads(self.files, self.context, self.sizes.length)
        self.keys = [ObjectKey("bench-model", 0, i.to_bytes(8, "big") * 4) for i in range(count)]
        self.size = payload_size
        # Page-aligned, pre-faulted targets, as an L1 arena gives them.
        self._arena = mmap.mmap(-1, (count + 1) * payload_size + RECORD_ALIGN)
        arena = memoryview(self._arena)
        arena[:] = bytes(len(arena))
        self.targets = [arena[i * payload_size : (i + 1) * payload_size] for i in range(count)]
        self.scratch = arena[count * payload_size : count * payload_size + RECORD_ALIGN]
        payload = np.random.default_rng(0).integers(0, 256, payload_size, dtype=np.uint8).tobytes()
        self.paths = [self.files.layout.path_for(key) for key in self.keys]
        self.headers: list[bytes] = []
        for key, path in zip(self.keys, self.paths, strict=True):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            header = self.context.record_header(key, memoryview(payload), align=RECORD_ALIGN)
            self.headers.append(header)
            with open(path, "wb") as handle:
                handle.write(header + payload)


def per_object(action: Callable[[], object], count: int, repeat: int) -> float:
    """Median over ``repeat`` rounds of one round's time per object, in microseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(times)


def bare_reads(store: Store, *, hashed: bool) -> Callable[[], None]:
    """``open`` + one ``preadv`` of header and payload + ``close`` per file (+ XXH3-128)."""

    def run() -> None:
        scratch = store.scratch
        for path, target in zip(store.paths, store.targets, strict=True):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            os.preadv(fd, [scratch, target], 0)
            os.close(fd)
            if hashed:
                checksum(target)

    return run


def reads_decoding(store: Store) -> Callable[[], None]:
    """``bare_reads`` (hashed) with the header check run between each copy and its hash:
    the price of Python work where a 1 MiB copy has just left it out of cache."""

    def run() -> None:
        scratch, check = store.scratch, store.context.read_record_header
        for key, path, target in zip(store.keys, store.paths, store.targets, strict=True):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            os.preadv(fd, [scratch, target], 0)
            os.close(fd)
            check(scratch, key)
            checksum(target)

    return run


def adapter_loads(store: Store) -> Callable[[], None]:
    def run() -> None:
        load = store.loads.load
        for key, target in zip(store.keys, store.targets, strict=True):
            if not load(key, target):
                raise SystemExit(f"load of {key} failed")

    return run


def batch_loads(store: Store, workers: BatchWorkers) -> Callable[[], None]:
    def run() -> None:
        if store.loads.load_many(store.keys, store.targets, workers) != [True] * len(store.keys):
            raise SystemExit("a batch load failed")

    return run


def interleaved(methods: dict[str, Callable[[], None]], count: int, rounds: int) -> dict[str, list[float]]:
    """Per-object microseconds of each method, one sample per round.  The methods take
    turns within each round, in alternating order, so drift of a shared machine (another
    job, the page cache, the CPU's clock) shifts all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_index in range(rounds):
        names = list(methods) if round_index % 2 == 0 else list(reversed(methods))
        for name in names:
            times[name].append(per_object(methods[name], count, 1))
    return times


def steps(store: Store, repeat: int) -> list[tuple[str, float]]:
    count = len(store.keys)
    keys, headers = store.keys, [memoryview(header) for header in store.headers]
    context, layout, length = store.context, store.files.layout, store.sizes.length
    serde = context._state.chain.names

    def each(step: Callable[[ObjectKey, memoryview], object]) -> Callable[[], None]:
        def run() -> None:
            for key, header in zip(keys, headers, strict=True):
                step(key, header)

        return run

    return [
        ("path of the key", per_object(each(lambda key, _h: layout.path_for(key)), count, repeat)),
        ("header length of the key", per_object(each(lambda key, _h: length(key)), count, repeat)),
        (
            "header check (read_record_header)",
            per_object(each(lambda key, header: context.read_record_header(header, key)), count, repeat),
        ),
        (
            "  decode_header alone",
            per_object(
                each(lambda key, header: decode_header(header, expected_key=key, expected_serde=serde)),
                count,
                repeat,
            ),
        ),
        ("open + preadv + close (bare)", per_object(bare_reads(store, hashed=False), count, repeat)),
    ]


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--dir", help="directory for the record files (default: a temp dir)")
    parser.add_argument("--count", type=at_least_one, default=64)
    parser.add_argument("--repeat", type=at_least_one, default=7)
    parser.add_argument("--payload-kib", type=at_least_one, default=1024)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-record-", dir=args.dir)
    try:
        print(f"1-minute load average {os.getloadavg()[0]:.2f}; {args.count} records, us per object")
        small = Store(str(Path(root) / "small"), args.count, RECORD_ALIGN)
        for name, micros in steps(small, args.repeat * 20):
            print(f"  steps    {name:<36} {micros:8.2f}")
        small_loads = interleaved(
            {"bare syscalls": bare_reads(small, hashed=False), "RecordLoads.load": adapter_loads(small)},
            args.count,
            args.repeat * 20,
        )
        bare = statistics.median(small_loads["bare syscalls"])
        loaded = statistics.median(small_loads["RecordLoads.load"])
        print(
            f"  loads    4 KiB: RecordLoads.load {loaded:8.2f}   bare syscalls {bare:8.2f}   "
            f"per-object work {loaded - bare:6.2f}"
        )
        large = Store(str(Path(root) / "large"), args.count, args.payload_kib << 10)
        one_thread = BatchWorkers(1, "bench-load")
        methods = {
            "preadv + XXH3": bare_reads(large, hashed=True),
            "  + header check between": reads_decoding(large),
            "RecordLoads.load": adapter_loads(large),
        }
        if hasattr(RecordLoads, "load_many"):  # absent from versions before it (a before/after run)
            methods["RecordLoads.load_many"] = batch_loads(large, one_thread)
        times = interleaved(methods, args.count, args.repeat * 2 + 1)
        limit = times["preadv + XXH3"]
        for name, values in times.items():
            ratio = statistics.median(b / a for a, b in zip(values, limit, strict=True))
            print(
                f"  payload  {args.payload_kib} KiB {name:<24} {statistics.median(values):8.2f}"
                f"   ratio to preadv + XXH3 {ratio:.2f}"
            )
        print(f"1-minute load average {os.getloadavg()[0]:.2f} after")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
