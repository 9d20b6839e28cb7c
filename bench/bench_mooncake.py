"""Store and load through the ``mooncake_store`` adapter next to Mooncake's own client.

A master and a segment host (``mooncake_client`` lending memory to the pool) run on
loopback; the adapter and a plain ``MooncakeDistributedStore`` both join the pool lending
none, so every object lands in the segment host for both.  The same bytes, from the same
pre-faulted buffers, are moved by:

* ``direct`` -- the Mooncake client itself: ``batch_put_from`` / ``batch_get_into`` of the
  whole batch from and into registered memory (its zero-copy path), and ``put_from`` /
  ``get_into`` of one object for the latencies; ``batch_is_exist`` for a lookup;
* ``adapter`` -- the adapter through the non-blocking interface the controllers use (one
  submitted batch; one key per task for the latencies), given the buffers' arena as its
  L1 (which it registers with its client, as a server does): a record (header and
  checksum) put in a put session, a lookup, a verified read of header and payload (into
  its registered L1 arena: one get session for the batch, then the two ranges of every
  record in one ``batch_get_into_multi_buffer_ranges``).  It too moves a batch in one
  Mooncake transfer call.  (On a busy machine the client's ranged read is
  faster than its ``batch_get_into`` on TCP, with half the CPU and without its ~3 ms
  stalls, so there the direct load, the client's plain batched get, is not its fastest
  read of the same bytes);
* ``records`` -- the client alone storing and reading objects laid out as the adapter's
  records (``batch_put_from_multi_buffers`` of a 4 KiB header scratch and the payload;
  read as the adapter reads them into L1, under one get session for the batch) with no
  lookup or checksum: what the record layout costs by itself, so that the rest of the gap
  (the checks and the adapter's threads) can be told apart.

Like for like: a load is timed alone on both sides (the adapter's lookup, which pins the
keys, runs untimed before it -- the client needs none to read); a lookup is timed next
to the client's existence query; and "lookup+load" times a hit as a reader of the pool
sees it, the adapter's lookup and load against the client's existence query and get.
(An earlier version timed the adapter's lookup inside its batch load but not the
client's, and always ran the client first in the per-object loops.)  The adapter's
figures include core's task hand-off (a worker thread, an eventfd) on every call, and
its stores run on core's write-back thread, which is ``SCHED_IDLE`` while write-back
keeps up: on a busy machine it runs after everything else.

Throughput is one batch of ``--objects`` x ``--size-mib`` (default 256 x 1 MiB); latency is
per object, ``--objects`` single-object calls, p50 and p99 (a round's p99 of 256 samples
is its third slowest).  Every timed load, batch or single, writes into a destination
wiped before it and compared with the stored bytes after (both untimed).  Methods run interleaved,
round by round (and object by object, who goes first alternating); every figure is the
median of ``--repeat`` rounds and the ratio is the median of per-round ratios
adapter/direct (throughput) or direct/adapter (latency), so higher is better and the
target is >= 0.8.

    python bench/bench_mooncake.py [--objects 256] [--size-mib 1] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from bench_args import BenchParser
from lmcache_plugin_mooncake import MooncakeStoreConfig
from lmcache_plugin_mooncake.backend import MooncakeStoreBackend
from lmcache_plugin_mooncake.cluster import LocalCluster, unavailable_reason
from lmcache_plugin_mooncake.headers import HEADER_BYTES, address_of

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient

MIB = 1 << 20
GB = 1e9
#: per-object latencies measured, in order
OPS = ("store", "lookup", "load")
#: batch operations measured (GB/s)
BATCH_OPS = ("store", "load", "lookup_load")


def region(size: int) -> memoryview:
    memory = mmap.mmap(-1, size)
    view = memoryview(memory)
    view[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    return view


def wiped(view: memoryview) -> None:
    """Zero a load's destination before it (untimed): bytes an earlier load, or the other
    method's, left there must not pass for its own."""
    np.frombuffer(view, dtype=np.uint8)[:] = 0


def check_loaded(who: str, what: str, loaded: memoryview, stored: memoryview) -> None:
    """Stop the run unless a timed load wrote what was stored (untimed): a load that
    reports success and writes nothing is a failure, not a fast load."""
    if not np.array_equal(np.frombuffer(loaded, dtype=np.uint8), np.frombuffer(stored, dtype=np.uint8)):
        raise SystemExit(f"the {who} {what} loaded other bytes than were stored")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Direct:
    """Mooncake's own client on the same bytes."""

    def __init__(self, cluster: LocalCluster, src: memoryview, dst: memoryview, headers: memoryview) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        code = self.store.setup(
            "127.0.0.1", cluster.metadata_server, 0, 16 * MIB, "tcp", "", cluster.master_server_address
        )
        assert code == 0, f"direct client set-up returned {code}"
        for view in (src, dst, headers):
            assert self.store.register_buffer(address_of(view), view.nbytes) == 0
        self.src, self.dst, self.headers = address_of(src), address_of(dst), address_of(headers)

    def warm_up(self, segment: int, size: int) -> None:
        """Write the whole segment once: the segment host's pages are faulted in on their
        first write (slow), which would otherwise land on whichever method wrote first."""
        names = [f"warm-up-{i}" for i in range(int(segment * 0.85) // size)]
        for start in range(0, len(names), 64):
            part = names[start : start + 64]
            self.store.batch_put_from(part, [self.src] * len(part), [size] * len(part))
        self.remove(names)

    def put_batch(self, names: list[str], size: int) -> None:
        codes = self.store.batch_put_from(
            names, [self.src + i * size for i in range(len(names))], [size] * len(names)
        )
        assert set(codes) == {0}, set(codes)

    def get_batch(self, names: list[str], size: int) -> None:
        codes = self.store.batch_get_into(
            names, [self.dst + i * size for i in range(len(names))], [size] * len(names)
        )
        assert set(codes) == {size}, set(codes)

    def _record_parts(
        self, names: list[str], payloads: int, size: int
    ) -> tuple[list[list[int]], list[list[int]]]:
        pointers = [[self.headers + i * HEADER_BYTES, payloads + i * size] for i in range(len(names))]
        return pointers, [[HEADER_BYTES, size]] * len(names)

    def put_records(self, names: list[str], size: int) -> None:
        """Objects laid out as the adapter's records (header scratch, payload) stored."""
        codes = self.store.batch_put_from_multi_buffers(names, *self._record_parts(names, self.src, size))
        assert set(codes) == {0}, set(codes)

    def get_records(self, names: list[str], size: int) -> None:
        """Those objects read as the adapter reads its records into its L1 arena, without
        verifying them: one get session for the batch, then each record's header into the
        scratch and payload into the destination, in one call."""
        assert self.store.batch_get_session_start(names) == [0] * len(names)
        try:
            pointers, sizes = self._record_parts(names, self.dst, size)
            codes = self.store.batch_get_into_multi_buffer_ranges(
                names, pointers, sizes, [[0, HEADER_BYTES]] * len(names)
            )
        finally:
            self.store.batch_get_session_end(names)
        assert set(codes) == {HEADER_BYTES + size}, set(codes)

    def exists(self, names: list[str]) -> None:
        """Ask the master whether the names exist, as a client does before reading."""
        assert self.store.batch_is_exist(names) == [1] * len(names)

    def exists_and_get(self, names: list[str], size: int) -> None:
        self.exists(names)
        self.get_batch(names, size)

    def put_one(self, name: str, index: int, size: int) -> None:
        assert self.store.put_from(name, self.src + index * size, size) == 0

    def get_one(self, name: str, index: int, size: int) -> None:
        assert self.store.get_into(name, self.dst + index * size, size) == size

    def remove(self, names: list[str]) -> None:
        self.store.batch_remove(names, True)


class Through:
    """The adapter, through the non-blocking interface."""

    def __init__(self, cluster: LocalCluster, arena: memoryview) -> None:
        settings = cluster.adapter(key_prefix=f"bench-{uuid.uuid4().hex[:8]}/")
        settings.pop("type")
        config = MooncakeStoreConfig(**settings)
        # The buffers are slices of one arena, as L1 extents are of L1's.
        facts = AdapterContext(index=0, name="0:mooncake_store", config=config, l1_buffer=arena)
        self.adapter: L2Adapter = create_adapter(MooncakeStoreBackend, config, facts)
        self.client = BlockingAdapterClient(self.adapter, timeout=120)

    def store(self, keys: list[ObjectKey], views: list[memoryview]) -> None:
        assert self.client.store(keys, views) == [True] * len(keys)

    def load(self, keys: list[ObjectKey], views: list[memoryview]) -> None:
        found = self.client.lookup_and_lock(keys)
        assert found.found == [True] * len(keys)
        assert self.client.load(keys, views) == [True] * len(keys)
        self.adapter.unlock(keys)

    def load_only(self, keys: list[ObjectKey], views: list[memoryview]) -> None:
        assert self.client.load(keys, views) == [True] * len(keys)

    def lookup(self, keys: list[ObjectKey]) -> None:
        assert self.client.lookup_and_lock(keys).found == [True] * len(keys)
        self.adapter.unlock(keys)


def timed(action: Callable[..., None], *args: Any) -> float:
    started = time.perf_counter()
    action(*args)
    return time.perf_counter() - started


def batch_round(
    tag: str, direct: Direct, through: Through, src: memoryview, dst: memoryview, size: int, count: int
) -> dict[str, float]:
    """One batch of ``count`` objects stored and loaded by each method."""
    names = [f"direct-{tag}-{i}" for i in range(count)]
    keys = [ObjectKey("bench", 0, f"{tag}-{i}".encode().ljust(16, b"."), 0) for i in range(count)]
    src_views = [src[i * size : (i + 1) * size] for i in range(count)]
    dst_views = [dst[i * size : (i + 1) * size] for i in range(count)]
    # Who goes first alternates from round to round, so that neither always runs on a
    # pool the other just warmed or fragmented.
    figures: dict[str, float] = {}
    order = ("direct", "adapter") if int(tag[1:]) % 2 == 0 else ("adapter", "direct")
    # store, then load alone (the adapter's lookup pins the keys first, untimed), then
    # what a reader of the pool does for a hit: ask, then read (the adapter's lookup and
    # load against the client's existence query and get)
    actions = {
        "store": (lambda: direct.put_batch(names, size), lambda: through.store(keys, src_views)),
        "load": (lambda: direct.get_batch(names, size), lambda: through.load_only(keys, dst_views)),
        "lookup_load": (
            lambda: direct.exists_and_get(names, size),
            lambda: through.load(keys, dst_views),
        ),
    }
    for op, (direct_action, adapter_action) in actions.items():
        for who in order:
            loads = op != "store"
            if loads:
                wiped(dst)
            if op == "load" and who == "adapter":
                found = through.client.lookup_and_lock(keys)
                assert found.found == [True] * count
                figures["adapter_load_s"] = timed(adapter_action)
                through.adapter.unlock(keys)
            else:
                figures[f"{who}_{op}_s"] = timed(direct_action if who == "direct" else adapter_action)
            if loads:
                check_loaded(who, f"batch {op}", dst, src)
    records = [f"records-{tag}-{i}" for i in range(count)]
    figures["records_store_s"] = timed(direct.put_records, records, size)
    figures["records_load_s"] = timed(direct.get_records, records, size)
    direct.remove(records)
    direct.remove(names)
    through.adapter.delete(keys)
    return figures


def latency_round(
    tag: str, direct: Direct, through: Through, src: memoryview, dst: memoryview, size: int, count: int
) -> dict[str, float]:
    """``count`` single-object stores, lookups, then loads, by each method: p50 and p99 in ms."""
    names = [f"direct-{tag}-single-{i}" for i in range(count)]
    keys = [ObjectKey("bench", 0, f"{tag}-s-{i}".encode().ljust(16, b"."), 0) for i in range(count)]
    samples: dict[str, list[float]] = {
        f"{who}_{op}": [] for op in OPS for who in ("direct", "adapter", "handoff")
    }
    # An empty task of the same kind: core's hand-off alone (a worker thread picks it up,
    # an eventfd wakes the waiter), which every adapter call pays and the client does not.
    empty = {
        "store": partial(through.client.store, [], []),
        "lookup": partial(through.client.lookup_and_lock, []),
        "load": partial(through.client.load, [], []),
    }

    def both(op: str, i: int, direct_action: Callable[[], None], adapter_action: Callable[[], None]) -> None:
        # Who goes first alternates from object to object: the second runs on a pool,
        # a master and CPU caches the first just used.
        pair = (("direct", direct_action), ("adapter", adapter_action))
        target, source = dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size]
        for who, action in pair if i % 2 == 0 else pair[::-1]:
            if op == "load":
                wiped(target)
            samples[f"{who}_{op}"].append(timed(action))
            if op == "load":
                check_loaded(who, f"load of object {i}", target, source)
        samples[f"handoff_{op}"].append(timed(empty[op]))

    for i in range(count):
        source = src[i * size : (i + 1) * size]
        both(
            "store",
            i,
            partial(direct.put_one, names[i], i, size),
            partial(through.store, [keys[i]], [source]),
        )
    for i in range(count):
        both("lookup", i, partial(direct.exists, [names[i]]), partial(through.lookup, [keys[i]]))
    through.client.lookup_and_lock(keys)
    for i in range(count):
        target = dst[i * size : (i + 1) * size]
        both(
            "load",
            i,
            partial(direct.get_one, names[i], i, size),
            partial(through.load_only, [keys[i]], [target]),
        )
    through.adapter.unlock(keys)
    direct.remove(names)
    through.adapter.delete(keys)
    figures: dict[str, float] = {}
    for name, values in samples.items():
        figures[f"{name}_p50_ms"] = percentile(values, 0.50) * 1e3
        figures[f"{name}_p99_ms"] = percentile(values, 0.99) * 1e3
    return figures


def one_round(
    tag: str, direct: Direct, through: Through, src: memoryview, dst: memoryview, size: int, count: int
) -> dict[str, float]:
    return {
        **batch_round(tag, direct, through, src, dst, size, count),
        **latency_round(tag, direct, through, src, dst, size, count),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    size, count = args.size_mib * MIB, args.objects
    loads_before = os.getloadavg()
    arena = region(2 * size * count + count * HEADER_BYTES)
    src, dst = arena[: size * count], arena[size * count : 2 * size * count]
    headers = arena[2 * size * count :]
    dst[:] = bytes(dst.nbytes)
    with tempfile.TemporaryDirectory(prefix="bench-mooncake-") as logs:
        cluster = LocalCluster(Path(logs)).start()
        try:
            segment = 3 * size * count + 256 * MIB
            cluster.add_segment_host(f"{segment // MIB}MB")
            direct = Direct(cluster, src, dst, headers)
            direct.warm_up(segment, size)
            through = Through(cluster, arena)
            rounds = [
                one_round(f"r{number}", direct, through, src, dst, size, count)
                for number in range(args.repeat)
            ]
            through.adapter.close()
            direct.store.close()
        finally:
            cluster.stop()
    total = size * count
    result: dict[str, Any] = {
        "objects": count,
        "size_bytes": size,
        "repeat": args.repeat,
        "load_average": [round(x, 2) for x in (loads_before[0], os.getloadavg()[0])],
        "cpus": os.cpu_count(),
    }
    for op in BATCH_OPS:
        result[f"direct_{op}_gbps"] = statistics.median(total / r[f"direct_{op}_s"] / GB for r in rounds)
        result[f"adapter_{op}_gbps"] = statistics.median(total / r[f"adapter_{op}_s"] / GB for r in rounds)
        result[f"{op}_gbps_ratio"] = statistics.median(
            r[f"direct_{op}_s"] / r[f"adapter_{op}_s"] for r in rounds
        )
    for op in ("store", "load"):
        result[f"records_{op}_gbps"] = statistics.median(total / r[f"records_{op}_s"] / GB for r in rounds)
        result[f"records_{op}_gbps_ratio"] = statistics.median(
            r[f"direct_{op}_s"] / r[f"records_{op}_s"] for r in rounds
        )
    for op in OPS:
        for q in ("p50", "p99"):
            for who in ("direct", "adapter"):
                result[f"{who}_{op}_{q}_ms"] = statistics.median(r[f"{who}_{op}_{q}_ms"] for r in rounds)
            result[f"{op}_{q}_ratio"] = statistics.median(
                r[f"direct_{op}_{q}_ms"] / r[f"adapter_{op}_{q}_ms"] for r in rounds
            )
        result[f"handoff_{op}_p50_ms"] = statistics.median(r[f"handoff_{op}_p50_ms"] for r in rounds)
        # the best ratio an adapter doing nothing but core's hand-off could reach
        result[f"{op}_p50_limit"] = statistics.median(
            r[f"direct_{op}_p50_ms"] / (r[f"direct_{op}_p50_ms"] + r[f"handoff_{op}_p50_ms"]) for r in rounds
        )
    return result


def report(result: dict[str, Any]) -> None:
    print(
        f"mooncake_store vs Mooncake's client: {result['objects']} x {result['size_bytes'] // MIB} MiB, "
        f"median of {result['repeat']} rounds (ratio: adapter as a fraction of direct, target >= 0.8)"
    )
    before, after = result["load_average"]
    print(f"(1-minute load average {before} at start, {after} at the end, on {result['cpus']} CPUs)")
    print(
        "what each side does: store -- direct put_from / batch_put_from; adapter: a record (4 KiB "
        "header + payload, checksum) in a put session, whose reservation refuses names the pool "
        "holds (no existence query); load -- direct get_into / batch_get_into; adapter: the "
        "ranged reads of the records (header, payload into L1) and their verification, the "
        "lookup before it untimed on "
        "both sides (the direct client needs none); lookup -- direct batch_is_exist; adapter: "
        "the same existence query (sizes come from core when it stored the keys); "
        "lookup+load -- a hit as a reader sees it: direct batch_is_exist + batch_get_into, "
        "adapter lookup + load.  The adapter's figures include core's task hand-offs (a "
        "worker thread and an eventfd per call) and its stores run on core's write-back "
        "thread (SCHED_IDLE while write-back keeps up: on a busy machine it waits for idle CPU)"
    )
    print(f"{'':<22}{'direct':>12}{'adapter':>12}{'ratio':>8}")
    labels = {"store": "store", "load": "load", "lookup_load": "lookup+load"}
    for op in BATCH_OPS:
        print(
            f"{labels[op] + ' GB/s':<22}{result[f'direct_{op}_gbps']:>12.2f}"
            f"{result[f'adapter_{op}_gbps']:>12.2f}{result[f'{op}_gbps_ratio']:>8.2f}"
        )
    for op in OPS:
        for q in ("p50", "p99"):
            print(
                f"{op + ' ' + q + ' ms/object':<22}{result[f'direct_{op}_{q}_ms']:>12.3f}"
                f"{result[f'adapter_{op}_{q}_ms']:>12.3f}{result[f'{op}_{q}_ratio']:>8.2f}"
            )
    print("core's task hand-off alone (an empty task of the kind), and the p50 ratio it leaves at best:")
    for op in OPS:
        print(
            f"{op + ' hand-off p50 ms':<22}{'':>12}{result[f'handoff_{op}_p50_ms']:>12.3f}"
            f"{result[f'{op}_p50_limit']:>8.2f}"
        )
    print("the record layout alone (the client moving header + payload, no checks; ratio to direct):")
    for op in ("store", "load"):
        records, ratio = result[f"records_{op}_gbps"], result[f"records_{op}_gbps_ratio"]
        print(f"{op + ' GB/s, records':<22}{'':>12}{records:>12.2f}{ratio:>8.2f}")


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--size-mib", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"Mooncake is not usable here: {reason}")
    result = run(args)
    print(json.dumps(result, indent=2)) if args.json else report(result)


if __name__ == "__main__":
    main()
