"""In-process throughput of the storage engine: store to L2 and prefetch back from it.

No server, no sockets: a StorageManager with ``mock`` adapters (optionally a cascade of
them), driven from one thread the way a front end drives it.

* store: reserve -> fill (one memcpy, as the shared-memory front end does it) -> commit,
  then ``flush`` until L2 holds everything; GB/s is committed bytes over the wall time
  including the L2 copies (a second memcpy per adapter, on the adapter's thread);
* prefetch: with L1 cleared, ``submit_prefetch`` for every prompt (``--concurrency`` in
  flight), wait for each, release; GB/s is loaded bytes over the wall time;
* lookups/s of prompts that are entirely in L1 (the hit path with no L2 work).

A store that does not reach every adapter, or a prefetch that does not find every object,
stops the run with what the engine counted as failures: a failed operation is quick, and
its figure would be a fast one.

Store and prefetch run ``--repeats`` times (L1 and L2 emptied in between) and the median
is printed with the first run.  The mock adapters fault their memory pool in at start
(``prefault``), like the L1 arena; with ``--mock '{}'`` the first run is where they touch
it for the first time, which is slow on some VMs, and later runs show the steady state of
a server whose L2 memory is recycled by deletes and eviction.

Each figure is printed next to its limit measured in the same run: object-sized copies
between pre-faulted buffers as large as the data moved (up to 512 MiB), so that caches
do not flatter it.  A limit is sampled once per round, between the engine's runs, and
its median over the ``--repeats`` rounds is what the engine's median is compared with:
the same number of runs under the same drift of a shared machine.  One copy of every
byte (``memcpy``) is the limit a prefetch cannot beat.  A store copies every byte
1 + adapters times on as many threads (the fill, then each adapter's L2 copy), so its
limit is ``memcpy xN``: that many threads copying the same bytes at once, which on a
small VM is bounded by memory bandwidth, not by cores.

    python bench/bench_engine.py --chunk-mb 1 --chunks 8 --prompts 64 --adapters 1
    python bench/bench_engine.py --mock '{"prefault": true, "bandwidth_bytes_per_s": 2000000000}'
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import deque
from typing import Any

import numpy as np
from bench_args import BenchParser, at_least_one

from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.storage import StorageManager

MIB = 1 << 20
GIB = 1 << 30
#: largest span the memcpy limit is measured over (two buffers of it are allocated)
MEMCPY_SPAN = 512 * MIB
#: the mock's memory is faulted in at start, as the L1 arena's is: first touches of fresh
#: pages are a cost of the VM, not of the engine (``--mock '{}'`` shows them)
DEFAULT_MOCK: dict[str, Any] = {"prefault": True}


def memcpy_seconds(size: int, total: int, *, threads: int = 1) -> float:
    """Seconds of one pass copying ``total`` bytes (at most MEMCPY_SPAN) in ``size``-byte
    pieces, between buffers faulted in before the clock starts (and freed after, so they
    do not hold memory while the engine runs).

    With ``threads`` > 1 every thread copies all of it at the same time (each into its own
    target): the time to move data when every byte is copied ``threads`` times at once,
    as a store does.
    """
    span = memcpy_span(size, total)
    source = np.full(span, 0x5A, dtype=np.uint8)  # np.full writes: pages are faulted
    targets = [np.ones(span, dtype=np.uint8) for _ in range(threads)]

    def copy_all(target: np.ndarray) -> None:
        for offset in range(0, span, size):
            np.copyto(target[offset : offset + size], source[offset : offset + size])

    workers = [threading.Thread(target=copy_all, args=(target,)) for target in targets[1:]]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    copy_all(targets[0])
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def memcpy_span(size: int, total: int) -> int:
    """Bytes one memcpy pass moves: whole objects, at most MEMCPY_SPAN."""
    return max(1, min(total, MEMCPY_SPAN) // size) * size


def prompt_keys(prompt: int, chunks: int) -> list[ObjectKey]:
    return [ObjectKey("bench", 0, prompt.to_bytes(4, "big") + i.to_bytes(4, "big")) for i in range(chunks)]


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--chunk-mb", type=float, default=1.0, help="object size in MiB")
    parser.add_argument("--chunks", type=at_least_one, default=8, help="chunks per prompt")
    parser.add_argument("--prompts", type=at_least_one, default=64)
    parser.add_argument("--adapters", type=at_least_one, default=1, help="mock adapters in the cascade")
    parser.add_argument("--concurrency", type=at_least_one, default=8, help="prefetches in flight")
    parser.add_argument("--l1-gb", type=float, default=1.0)
    parser.add_argument(
        "--repeats", type=at_least_one, default=3, help="store/prefetch rounds (median printed)"
    )
    parser.add_argument(
        "--mock",
        default=json.dumps(DEFAULT_MOCK),
        help="mock adapter options besides max_size_gb, as JSON (replaces the default)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead")
    args = parser.parse_args()

    size = int(args.chunk_mb * MIB)
    total = size * args.chunks * args.prompts
    registry = load_registry()
    mock: dict[str, Any] = {"type": "mock", "max_size_gb": total / GIB + 0.01, **json.loads(args.mock)}
    adapters = tuple(decode_adapter(registry, dict(mock), index) for index in range(args.adapters))
    config = ServerConfig(
        l1_size_gb=args.l1_gb, l2_adapters=adapters, l2_prefetch_max_in_flight=args.concurrency
    )
    prompts = [prompt_keys(p, args.chunks) for p in range(args.prompts)]
    fill = np.full(size, 0xA5, dtype=np.uint8)
    copies = 1 + args.adapters
    span = memcpy_span(size, total)

    store_runs: list[float] = []
    prefetch_runs: list[float] = []
    # The limits are sampled once per round, between the engine's runs, so both sides get
    # the same number of runs under the same drift of a shared machine and are compared
    # median to median.  A store copies each byte 1 + adapters times at once: the fill,
    # and one L2 copy per adapter on that adapter's thread.
    limit_runs: list[float] = []
    store_limit_runs: list[float] = []
    with StorageManager(config, registry) as storage:
        for _ in range(args.repeats):
            store_limit_runs.append(span / memcpy_seconds(size, total, threads=copies) / 1e9)
            for adapter in storage.adapters:
                adapter.delete(list(adapter.iter_keys()))
            storage.clear()
            store_runs.append(total / store_round(storage, prompts, fill) / 1e9)
            storage.clear()
            limit_runs.append(span / memcpy_seconds(size, total) / 1e9)
            prefetch_runs.append(total / prefetch_round(storage, prompts, args.concurrency) / 1e9)
        limit, store_limit = statistics.median(limit_runs), statistics.median(store_limit_runs)

        storage.clear()
        resident = prompts[: max(1, int(args.l1_gb * GIB * 0.5) // (size * args.chunks))]
        for keys in resident:
            reserved = storage.reserve_write(keys, [size] * len(keys))
            storage.commit_write(list(reserved))
        lookups = 0
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            keys = resident[lookups % len(resident)]
            hits = storage.wait_prefetch(storage.submit_prefetch(keys), 10) or 0
            storage.release(keys[:hits])
            lookups += 1
        lookup_s = time.perf_counter() - start
        failures = storage.status()["failures"]

    if args.json:
        figures = {
            "memcpy_gbps": limit, "store_limit_gbps": store_limit,
            "store_gbps": statistics.median(store_runs),
            "prefetch_gbps": statistics.median(prefetch_runs), "lookups_per_s": lookups / lookup_s,
            "failures": failures,
        }  # fmt: skip
        print(json.dumps(figures))
        return
    extra = {key: value for key, value in mock.items() if key not in ("type", "max_size_gb")}
    print(f"objects {size / MIB:.2f} MiB x {args.chunks} chunks x {args.prompts} prompts")
    print(f"adapters: {args.adapters} mock {json.dumps(extra)}, prefetches in flight: {args.concurrency}")
    runs = f"median of {args.repeats}, interleaved with the engine's rounds"
    print(f"{'memcpy':<25} {limit:8.2f} GB/s  (limit of one copy, over {span / MIB:.0f} MiB; {runs})")
    parallel = f"memcpy x{copies} at once"
    print(f"{parallel:<25} {store_limit:8.2f} GB/s  (limit of a store: {copies} copies per byte; {runs})")
    for label, engine_runs, reference, name in (
        ("store to L2", store_runs, store_limit, f"memcpy x{copies}"),
        ("prefetch from L2", prefetch_runs, limit, "memcpy"),
    ):
        median = statistics.median(engine_runs)
        print(
            f"{label:<25} {median:8.2f} GB/s  {median / reference:6.1%} of {name}, median to median"
            f"  (median of {len(engine_runs)}; first run {engine_runs[0]:.2f} GB/s)"
        )
    print(f"L1-only lookups           {lookups / lookup_s:8.0f} /s")
    if failures:
        print(f"failures: {failures}")


def store_round(storage: StorageManager, prompts: list[list[ObjectKey]], fill: np.ndarray) -> float:
    """Seconds to store every prompt's objects in L1 and, through ``flush``, in every L2
    adapter.  A store that did not reach every adapter (refused by a full one, dropped
    before its write-back) would be counted as fast: the run stops instead."""
    size, expected = fill.nbytes, sum(map(len, prompts))
    start = time.perf_counter()
    for keys in prompts:
        reserved = storage.reserve_write(keys, [size] * len(keys))
        for obj in reserved.values():
            np.copyto(np.frombuffer(storage.view(obj), dtype=np.uint8), fill)
        storage.commit_write(list(reserved))
    flushed = storage.flush(600)
    seconds = time.perf_counter() - start
    held = [sum(1 for _ in adapter.iter_keys()) for adapter in storage.adapters]
    if not flushed or any(count != expected for count in held):
        raise SystemExit(
            f"store: the L2 adapters hold {held} of {expected} objects"
            f"{'' if flushed else ' (flush timed out)'}; failures {storage.failures()}"
        )
    return seconds


def prefetch_round(storage: StorageManager, prompts: list[list[ObjectKey]], concurrency: int) -> float:
    """Seconds to prefetch every prompt from L2 (``concurrency`` in flight).  A prefetch
    that found less than the whole prompt would be counted as fast: the run stops instead."""
    pending: deque[tuple[int, list[ObjectKey]]] = deque()
    loaded, expected = 0, sum(map(len, prompts))
    start = time.perf_counter()
    for keys in prompts:
        pending.append((storage.submit_prefetch(keys), keys))
        while len(pending) >= concurrency:
            loaded += settle(storage, *pending.popleft())
    while pending:
        loaded += settle(storage, *pending.popleft())
    seconds = time.perf_counter() - start
    if loaded != expected:
        raise SystemExit(f"prefetch: loaded {loaded} of {expected} objects; failures {storage.failures()}")
    return seconds


def settle(storage: StorageManager, handle: int, keys: list[ObjectKey]) -> int:
    hits = storage.wait_prefetch(handle, 600) or 0
    storage.release(keys[:hits])
    return hits


if __name__ == "__main__":
    main()
