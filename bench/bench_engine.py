"""In-process throughput of the storage engine: store to L2 and prefetch back from it.

No server, no sockets: a StorageManager with ``mock`` adapters (optionally a cascade of
them), driven from one thread the way a front end drives it.

* store: reserve -> fill (one memcpy) -> commit, then ``flush`` until L2 holds everything;
  GB/s is committed bytes over the wall time including the L2 copies;
* prefetch: with L1 cleared, ``submit_prefetch`` for every prompt (``--concurrency`` in
  flight), wait for each, release; GB/s is loaded bytes over the wall time;
* lookups/s of prompts that are entirely in L1 (the hit path with no L2 work).

Each figure is printed next to ``memcpy`` GB/s measured in the same run (bytes copied
between two buffers of the same object size), the limit one L1 copy cannot beat.

    python bench/bench_engine.py --chunk-mb 1 --chunks 8 --prompts 64 --adapters 1
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.storage import StorageManager

MIB = 1 << 20
GIB = 1 << 30


def memcpy_gbps(size: int, seconds: float = 0.5) -> float:
    source = memoryview(bytearray(b"\x5a" * size))
    target = memoryview(bytearray(size))
    copied = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        target[:] = source
        copied += size
    return copied / (time.perf_counter() - start) / 1e9


def prompt_keys(prompt: int, chunks: int) -> list[ObjectKey]:
    return [ObjectKey("bench", 0, prompt.to_bytes(4, "big") + i.to_bytes(4, "big")) for i in range(chunks)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunk-mb", type=float, default=1.0, help="object size in MiB")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per prompt")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=1, help="mock adapters in the cascade")
    parser.add_argument("--concurrency", type=int, default=8, help="prefetches in flight")
    parser.add_argument("--l1-gb", type=float, default=1.0)
    args = parser.parse_args()

    size = int(args.chunk_mb * MIB)
    total = size * args.chunks * args.prompts
    registry = load_registry()
    adapters = tuple(
        decode_adapter(registry, {"type": "mock", "max_size_gb": 2 * total / GIB + 0.01}, index)
        for index in range(args.adapters)
    )
    config = ServerConfig(
        l1_size_gb=args.l1_gb, l2_adapters=adapters, l2_prefetch_max_in_flight=args.concurrency
    )
    prompts = [prompt_keys(p, args.chunks) for p in range(args.prompts)]
    fill = b"\xa5" * size
    limit = memcpy_gbps(size)

    with StorageManager(config, registry) as storage:
        start = time.perf_counter()
        for keys in prompts:
            reserved = storage.reserve_write(keys, [size] * len(keys))
            for obj in reserved.values():
                storage.view(obj)[:] = fill
            storage.commit_write(list(reserved))
        storage.flush(600)
        store_s = time.perf_counter() - start

        storage.clear()
        pending: deque[tuple[int, list[ObjectKey]]] = deque()
        loaded = 0
        start = time.perf_counter()
        for keys in prompts:
            pending.append((storage.submit_prefetch(keys), keys))
            while len(pending) >= args.concurrency:
                loaded += settle(storage, *pending.popleft())
        while pending:
            loaded += settle(storage, *pending.popleft())
        prefetch_s = time.perf_counter() - start

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

    store_gbps = total / store_s / 1e9
    prefetch_gbps = loaded * size / prefetch_s / 1e9
    print(f"objects {size / MIB:.2f} MiB x {args.chunks} chunks x {args.prompts} prompts")
    print(f"adapters: {args.adapters} mock, prefetches in flight: {args.concurrency}")
    print(f"memcpy                    {limit:8.2f} GB/s  (limit of one copy)")
    print(f"store to L2               {store_gbps:8.2f} GB/s  {store_gbps / limit:6.1%} of memcpy")
    print(f"prefetch from L2          {prefetch_gbps:8.2f} GB/s  {prefetch_gbps / limit:6.1%} of memcpy")
    print(f"L1-only lookups           {lookups / lookup_s:8.0f} /s")
    if failures:
        print(f"failures: {failures}")


def settle(storage: StorageManager, handle: int, keys: list[ObjectKey]) -> int:
    hits = storage.wait_prefetch(handle, 600) or 0
    storage.release(keys[:hits])
    return hits


if __name__ == "__main__":
    main()
