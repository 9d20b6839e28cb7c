"""Store and load through the ``s3`` adapter next to s3fs doing direct put/get of the same bytes.

One S3 server (SeaweedFS ``weed mini`` on loopback, started here unless ``--endpoint`` is
given), one case (default 256 x 1 MiB), two methods run interleaved, round by round, after an
untimed round of both (a fresh server's first writes are slow):

* ``s3fs direct`` -- the store's own client: ``_pipe_file`` / ``_cat_file`` of each object,
  all in flight at once (at most ``--inflight``), built with the adapter's client settings
  (same timeouts, connection pool and checksum options) so the difference is the adapter;
* ``s3 adapter``  -- one batch through the adapter's non-blocking interface, as the
  store and prefetch controllers submit it: records with a header and a checksum, the
  checksum verified on load, the payload copied into the L1 buffer.

Throughput: GB/s of payload for the whole batch, median of ``--repeat`` rounds, with the
adapter's ratio to the direct client (target >= 0.8; a ratio is the median of per-round
ratios, which cancels most of a shared machine's drift).  Latency: one object at a time,
``--latency-objects`` of them (who goes first alternating; a p99 of the default 128 samples
is the second slowest), p50 / p99 in ms for put/store and get/load, every result and every
loaded byte checked (untimed); the adapter's
lookup (a HEAD: the header copy in the object's metadata, decoded and checked) is shown
next to a bare ``head_object`` call of the same client.
The server shares the machine's cores with the client, so on a small machine the figures
are the server's as much as the client's -- which is why both run against the same one.

``--opens N`` measures opening instead: N adapters opened and closed one after another
(each one's start-up check and its own client: two botocore sessions), next to N bare
s3fs filesystems (``S3FileSystem`` with its own botocore session, then ``set_session``).
The first adapter of a process is shown apart: it reads botocore's service models, which
later ones share.

    python bench/bench_s3.py [--cases 256x1] [--repeat 3] [--inflight 32] [--json]
        [--endpoint URL --bucket NAME]   (credentials from the AWS environment)
    python bench/bench_s3.py --opens 10 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import s3fs
from bench_args import BenchParser, whole_number_from
from lmcache_plugin_s3 import S3Config
from lmcache_plugin_s3.client import open_filesystem

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.seaweedfs import SeaweedS3

MIB = 1 << 20
GB = 1e9
BUCKET = "tiers-bench"
T = TypeVar("T")


@dataclass
class Figures:
    method: str
    store_gbps: float
    load_gbps: float
    store_ms: tuple[float, float]  # p50, p99
    load_ms: tuple[float, float]
    lookup_ms: tuple[float, float]
    store_ratio: float | None = None
    load_ratio: float | None = None
    runs: dict[str, list[float]] = field(default_factory=dict)


class Loop:
    """An event loop on a thread of its own, for the direct client (the adapter has its own)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


class Direct:
    """s3fs on its own, with the adapter's client settings."""

    def __init__(self, config: S3Config, loop: Loop, inflight: int) -> None:
        self.loop = loop
        self.config = config
        self.fs = loop.run(self._open())
        self.slots = asyncio.Semaphore(inflight)

    async def _open(self) -> Any:
        fs = open_filesystem(self.config)
        # One GET per object: with more, _cat_file asks for the size first (a HEAD).
        fs.max_concurrency = 1
        await fs.set_session()
        return fs

    def path(self, name: str) -> str:
        return f"{self.config.bucket}/{self.config.prefix}/direct-{name}"

    async def _bounded(self, make: Callable[[], Awaitable[T]]) -> T:
        async with self.slots:
            return await make()

    def put_all(self, names: list[str], sources: list[memoryview]) -> None:
        async def run() -> None:
            await asyncio.gather(
                *(
                    self._bounded(lambda n=n, s=s: self.fs._pipe_file(self.path(n), bytes(s)))
                    for n, s in zip(names, sources, strict=True)
                )
            )

        self.loop.run(run())

    def get_all(self, names: list[str], targets: list[memoryview]) -> None:
        async def one(name: str, target: memoryview) -> None:
            data = await self.fs._cat_file(self.path(name))
            target[:] = data

        async def run() -> None:
            await asyncio.gather(
                *(self._bounded(lambda n=n, t=t: one(n, t)) for n, t in zip(names, targets, strict=True))
            )

        self.loop.run(run())

    def head(self, name: str) -> None:
        # The bare API call (s3fs's _info adds its own bookkeeping): the tightest limit.
        bucket, key = self.path(name).split("/", 1)
        self.loop.run(self.fs._call_s3("head_object", Bucket=bucket, Key=key))

    def delete_all(self, names: list[str]) -> None:
        self.loop.run(self.fs._rm([self.path(name) for name in names]))

    def close(self) -> None:
        async def close() -> None:
            await self.fs._s3creator.__aexit__(None, None, None)

        self.loop.run(close())


class Arena:
    """Source and target objects in one pre-faulted arena (like L1)."""

    def __init__(self, count: int, size: int) -> None:
        self.memory = np.empty(2 * count * size, dtype=np.uint8)
        self.memory[: count * size] = np.random.default_rng(0).integers(0, 256, count * size, dtype=np.uint8)
        self.memory[count * size :] = 0
        view = memoryview(self.memory).cast("B")
        self.view = view
        self.sources = [view[i * size : (i + 1) * size] for i in range(count)]
        self.targets = [view[(count + i) * size : (count + i + 1) * size] for i in range(count)]

    def clear_targets(self) -> None:
        self.memory[len(self.memory) // 2 :] = 0

    def verify(self) -> None:
        if any(source != target for source, target in zip(self.sources, self.targets, strict=True)):
            raise SystemExit("loaded bytes differ from the stored bytes")


def timed(action: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    action(*args)
    return time.perf_counter() - start


def checked(what: str, call: Callable[..., list[bool]], *args: Any) -> None:
    results = call(*args)
    if not all(results):
        raise SystemExit(f"adapter {what} failed for {results.count(False)} of {len(results)} objects")


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return (
        1e3 * ordered[len(ordered) // 2],
        1e3 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    )


def open_adapter(config: S3Config, l1: memoryview) -> L2Adapter:
    registry = load_registry()
    factory = registry.get(Kind.L2_ADAPTER, "s3").load()
    context = AdapterContext(index=0, name="0:s3", config=config, l1_buffer=l1)
    return create_adapter(factory, config, context, registry=registry, type_name="s3")


def measure_opens(config: S3Config, runs: int) -> dict[str, Any]:
    """Seconds to open an adapter and a bare s3fs filesystem, ``runs`` of each, alternating;
    closing is not timed."""
    l1 = memoryview(bytearray(MIB))
    loop = Loop()

    async def bare_open() -> s3fs.S3FileSystem:
        fs = s3fs.S3FileSystem(
            asynchronous=True,
            loop=asyncio.get_running_loop(),
            skip_instance_cache=True,
            endpoint_url=config.endpoint_url,
        )
        await fs.set_session()
        return fs

    async def bare_close(fs: s3fs.S3FileSystem) -> None:
        await fs._s3creator.__aexit__(None, None, None)

    adapter_s: list[float] = []
    bare_s: list[float] = []
    try:
        for _ in range(runs):
            start = time.perf_counter()
            adapter = open_adapter(config, l1)
            adapter_s.append(time.perf_counter() - start)
            adapter.close()
            start = time.perf_counter()
            fs = loop.run(bare_open())
            bare_s.append(time.perf_counter() - start)
            loop.run(bare_close(fs))
    finally:
        loop.close()
    later = adapter_s[1:]
    return {
        "adapter_first_s": adapter_s[0],
        "adapter_later_median_s": statistics.median(later) if later else None,
        "bare_s3fs_median_s": statistics.median(bare_s),
        "runs": runs,
        "adapter_s": adapter_s,
        "bare_s3fs_s": bare_s,
    }


def print_opens(where: str, opens: dict[str, Any]) -> None:
    later = opens["adapter_later_median_s"]
    print(f"\nopen, {opens['runs']} of each  ({where}, {os.cpu_count()} cores)")
    print(f"s3 adapter, first in the process   {opens['adapter_first_s']:.3f} s")
    if later is not None:
        print(f"s3 adapter, later ones (median)    {later:.3f} s")
    print(f"bare s3fs open (median)            {opens['bare_s3fs_median_s']:.3f} s")
    print("(an adapter: its start-up check -- a session, a client, one listing -- and its own")
    print(" session and client; a bare s3fs open: one session and client, no request)")


def keys_for(tag: str, count: int) -> list[ObjectKey]:
    return [ObjectKey("bench-model", 0, f"{tag}/{i}".encode().ljust(32, b".")[:32]) for i in range(count)]


def run_case(count: int, size: int, args: argparse.Namespace, config: S3Config) -> list[Figures]:
    arena = Arena(count, size)
    loop = Loop()
    direct = Direct(config, loop, args.inflight)
    adapter = open_adapter(config, arena.view)
    client = BlockingAdapterClient(adapter, timeout=600)
    total = count * size
    runs: dict[str, dict[str, list[float]]] = {"s3fs direct": {}, "s3 adapter": {}}
    try:
        # An untimed round of both methods first: a fresh server's first writes (its
        # volumes growing) ran several times slower than later ones, and fell on whichever
        # method went first in the first round.
        warm_names, warm_keys = [f"warm-up-{i}" for i in range(count)], keys_for("warm-up", count)
        direct.put_all(warm_names, arena.sources)
        direct.get_all(warm_names, arena.targets)
        checked("store", client.store, warm_keys, arena.sources)
        checked("load", client.load, warm_keys, arena.targets)
        direct.delete_all(warm_names)
        adapter.delete(warm_keys)
        for round_index in range(args.repeat):
            names = [f"r{round_index}-{i}" for i in range(count)]
            keys = keys_for(f"r{round_index}", count)

            phases = {
                "s3fs direct": {
                    "store": partial(direct.put_all, names, arena.sources),
                    "load": partial(direct.get_all, names, arena.targets),
                },
                "s3 adapter": {
                    "store": partial(checked, "store", client.store, keys, arena.sources),
                    "load": partial(checked, "load", client.load, keys, arena.targets),
                },
            }
            # Who goes first alternates, so neither gains from the other's warm-up.
            order = list(phases) if round_index % 2 == 0 else list(reversed(phases))
            for op in ("store", "load"):
                for method in order:
                    arena.clear_targets()
                    runs[method].setdefault(op, []).append(total / timed(phases[method][op]) / GB)
                    if op == "load":
                        arena.verify()
            direct.delete_all(names)
            adapter.delete(keys)
        latency = measure_latency(direct, adapter, client, arena, args.latency_objects)
    finally:
        adapter.close()
        direct.close()
        loop.close()
    results = [
        Figures(
            method,
            statistics.median(record["store"]),
            statistics.median(record["load"]),
            latency[method]["store"],
            latency[method]["load"],
            latency[method]["lookup"],
            runs=record,
        )
        for method, record in runs.items()
    ]
    base, mine = results
    mine.store_ratio = statistics.median(
        a / b for a, b in zip(mine.runs["store"], base.runs["store"], strict=True)
    )
    mine.load_ratio = statistics.median(
        a / b for a, b in zip(mine.runs["load"], base.runs["load"], strict=True)
    )
    return results


def measure_latency(
    direct: Direct, adapter: L2Adapter, client: BlockingAdapterClient, arena: Arena, objects: int
) -> dict[str, dict[str, tuple[float, float]]]:
    """One object at a time: what a single chunk's round trip costs each way.  Who goes
    first alternates from object to object (the second finds the server and the CPU's
    caches as the first left them); every adapter call's result is checked, and every
    load writes into a target wiped before it and compared with the stored bytes after
    (untimed), so that a failed call is never timed as a fast one."""
    samples: dict[str, dict[str, list[float]]] = {
        "s3fs direct": {"store": [], "load": [], "lookup": []},
        "s3 adapter": {"store": [], "load": [], "lookup": []},
    }
    count = min(objects, len(arena.sources))
    names = [f"lat-{i}" for i in range(count)]
    keys = keys_for("lat", count)
    mine, theirs = samples["s3 adapter"], samples["s3fs direct"]

    def adapter_lookup(key: ObjectKey) -> None:
        if not all(client.lookup_and_lock([key]).found):
            raise SystemExit("adapter lookup missed an object it had stored")

    for index, (name, key, source, target) in enumerate(
        zip(names, keys, arena.sources[:count], arena.targets[:count], strict=True)
    ):
        sides = [
            (
                theirs,
                partial(direct.put_all, [name], [source]),
                partial(direct.head, name),
                partial(direct.get_all, [name], [target]),
            ),
            (
                mine,
                partial(checked, "store", client.store, [key], [source]),
                partial(adapter_lookup, key),
                partial(checked, "load", client.load, [key], [target]),
            ),
        ]
        for side, store, lookup, load in sides if index % 2 == 0 else sides[::-1]:
            side["store"].append(timed(store))
            side["lookup"].append(timed(lookup))
            target[:] = bytes(len(target))
            try:
                side["load"].append(timed(load))
            finally:
                if side is mine:
                    adapter.unlock([key])
            if target != source:
                raise SystemExit(
                    f"{'adapter' if side is mine else 's3fs'} loaded other bytes than were stored"
                )
    direct.delete_all(names)
    adapter.delete(keys)
    return {
        method: {op: percentiles(values) for op, values in ops.items()} for method, ops in samples.items()
    }


def _row(cells: tuple[str, ...]) -> str:
    widths = (13, 16, 16, 18, 17, 19)
    return " ".join(
        f"{text:<{w}}" if i == 0 else f"{text:>{w}}"
        for i, (text, w) in enumerate(zip(cells, widths, strict=True))
    )


def print_table(label: str, where: str, results: list[Figures]) -> None:
    print(f"\n{label}  ({where}, {os.cpu_count()} cores)")
    print(
        _row(
            ("method", "store GB/s", "load GB/s", "store p50/p99 ms", "load p50/p99 ms", "lookup p50/p99 ms")
        )
    )
    for figures in results:
        store_ratio = f" ({figures.store_ratio:.2f}x)" if figures.store_ratio else ""
        load_ratio = f" ({figures.load_ratio:.2f}x)" if figures.load_ratio else ""
        latencies = (figures.store_ms, figures.load_ms, figures.lookup_ms)
        cells = (
            figures.method,
            f"{figures.store_gbps:.3f}{store_ratio}",
            f"{figures.load_gbps:.3f}{load_ratio}",
            *(f"{p50:.2f} / {p99:.2f}" for p50, p99 in latencies),
        )
        print(_row(cells))
    print("(ratios: adapter / direct, median of per-round ratios; target >= 0.8. direct lookup = a bare")
    print(" head_object, adapter lookup = a HEAD whose header copy is decoded and checked)")


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--cases", default="256x1", help="COUNTxMIB[,COUNTxMIB...] (default 256x1)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per case (default 3)")
    parser.add_argument(
        "--inflight", type=int, default=32, help="requests in flight, both methods (default 32)"
    )
    parser.add_argument(
        "--latency-objects", type=int, default=128, help="objects timed one by one (default 128)"
    )
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of a local SeaweedFS")
    parser.add_argument(
        "--bucket", default=BUCKET, help=f"bucket (default {BUCKET}; must exist with --endpoint)"
    )
    parser.add_argument(
        "--opens",
        type=whole_number_from(1),
        help="measure opening instead: N adapters next to N bare s3fs filesystems",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    server: SeaweedS3 | None = None
    data_dir: str | None = None
    if args.endpoint is None:
        data_dir = tempfile.mkdtemp(prefix="bench-s3-")
        server = SeaweedS3(data_dir, buckets=[args.bucket])
        server.start()
        os.environ.update(server.env)
        endpoint, where = server.endpoint, "SeaweedFS weed mini on loopback"
    else:
        endpoint, where = args.endpoint, args.endpoint
    config = S3Config(
        bucket=args.bucket,
        prefix=f"bench-{uuid.uuid4().hex[:8]}",
        endpoint_url=endpoint,
        max_inflight=args.inflight,
    )
    report = []
    try:
        if args.opens is not None:
            opens = measure_opens(config, args.opens)
            if args.json:
                print(json.dumps({"where": where, **opens}, indent=2))
            else:
                print_opens(where, opens)
            return
        for item in args.cases.split(","):
            count, mib = (int(part) for part in item.lower().split("x"))
            results = run_case(count, mib * MIB, args, config)
            label = f"{count} x {mib} MiB"
            report.append({"case": label, "where": where, "results": [asdict(r) for r in results]})
            if not args.json:
                print_table(label, where, results)
    finally:
        if server is not None:
            server.close()
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)  # a run leaves gigabytes of volumes
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
