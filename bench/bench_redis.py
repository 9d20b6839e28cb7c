"""Store and load through the redis adapter next to redis-py's own put/get of the same bytes.

A real ``redis-server`` (no persistence) is started on loopback.  For ``--objects`` x
``--size-mib`` (default 256 x 1 MiB) the same bytes, from one pre-faulted arena standing
in for L1, are written and read back by:

* ``redis-py``  -- the client library used directly, as its documentation shows: pipelined
  ``SET key value`` / ``GET key`` of the same bytes per round trip as the adapter sends
  (its ``pipeline_max_bytes``, 8 MiB), each reply copied into the arena (where an engine
  needs the bytes);
* ``redis-py/batch`` -- the same, each batch in one pipeline (throughput only): the adapter
  has one store trip in flight at a time, as ``redis-py`` has, but a load sends its next
  trip before it reads the replies of the current one (two in flight); this baseline has
  the whole batch (``--batch`` objects) in flight, so it is allowed more than the adapter;
* ``adapter``   -- the ``redis`` adapter through the non-blocking interface the
  controllers use (core's task board, pins, accounting and circuit breaker included),
  batches of ``--batch`` keys: records with a checksum written, every load verified.

Per-object latency is one object at a time, timed from the call to its bytes in the
arena, as each side's user would write it: redis-py ``SET`` / ``GET`` (plain commands, no
pipeline of one) plus the copy into the arena; the adapter's store task, and its load
task -- ``load`` after an untimed lookup (an engine looks a chunk up when it schedules the
request and loads it later), ``lookup+load`` both timed (what fetching one chunk costs
end to end; redis-py's single ``GET`` needs no lookup, the adapter's contract pins and
sizes a chunk first, so this row is the adapter's worst case).  Rounds interleave the
methods, in the order above in even rounds and reversed in odd ones (so that none always
runs on what the same other one left behind: warm connections, the server's freed
memory, the CPU's clock), and load latencies interleave them object by object (a busy
machine's drift hits both alike); store latencies are taken one method after the other,
who goes first alternating from round to round (``one_at_a_time`` says why).  Every timed
load, batch or single object, writes into a destination zeroed before it and is compared
with the stored bytes after it (both untimed): a load that reports success and writes
nothing stops the run.  Each method's objects are deleted once it has loaded them, so
every method stores into a server holding none of the others', into memory the one
before it freed: left stored, the later methods' values took new pages the server had to
fault in (~65,000 a round of 256 MiB) where the first of a round reused some the last
round freed (~50,000 faults), a head start that was the bench's order, not the client's.
Throughput is the median of ``--repeat`` rounds,
latency percentiles are over every object of every round, each printed next to redis-py's
and with the ratio of redis-py's latency to the adapter's (>= 0.8 is the target;
throughput ratios are medians of per-round ratios, which
cancels most of a shared machine's drift).

    python bench/bench_redis.py [--objects 256] [--size-mib 1] [--batch 32] [--repeat 5] [--json]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis
from bench_args import BenchParser
from lmcache_plugin_redis import RedisConfig
from lmcache_plugin_redis.backend import trips
from lmcache_plugin_redis.testing import RedisServer, missing_reason
from rounds import round_order

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.testing.blocking import BlockingAdapterClient


def arena(size: int) -> memoryview:
    """A pre-faulted buffer (first touches of fresh memory are slow here)."""
    array = np.ones(size, dtype=np.uint8)
    return memoryview(array).cast("B")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class Direct:
    """redis-py used directly: SET and GET of whole values in pipelines of at most
    ``max_bytes`` of values, split as the adapter splits its batches."""

    def __init__(
        self,
        url: str,
        views: list[memoryview],
        targets: list[memoryview],
        max_bytes: int,
        prefix: str = "direct",
    ) -> None:
        self.client = redis.Redis.from_url(url)
        self.names = [f"{prefix}:{index}" for index in range(len(views))]
        self.views, self.targets, self.max_bytes = views, targets, max_bytes

    def _trips(self, indices: range) -> list[range]:
        sizes = [self.views[index].nbytes for index in indices]
        return [indices[trip.start : trip.stop] for trip in trips(sizes, self.max_bytes)]

    def store(self, indices: range) -> None:
        for trip in self._trips(indices):
            pipe = self.client.pipeline(transaction=False)
            for index in trip:
                pipe.set(self.names[index], self.views[index])
            pipe.execute()

    def load(self, indices: range) -> None:
        for trip in self._trips(indices):
            pipe = self.client.pipeline(transaction=False)
            for index in trip:
                pipe.get(self.names[index])
            for index, value in zip(trip, pipe.execute(), strict=True):
                self.targets[index][:] = value

    def store_one(self, index: int) -> None:
        self.client.set(self.names[index], self.views[index])

    def load_one(self, index: int) -> None:
        value = self.client.get(self.names[index])
        assert value is not None, "a GET missed"
        self.targets[index][:] = value

    def clear(self) -> None:
        self.client.delete(*self.names)


class ThroughAdapter:
    """The redis adapter, driven as the store and prefetch controllers drive it."""

    def __init__(self, adapter: L2Adapter, views: list[memoryview], targets: list[memoryview]) -> None:
        self.adapter = adapter
        self.client = BlockingAdapterClient(adapter, timeout=120)
        self.keys = [ObjectKey("bench", 0, index.to_bytes(8, "big")) for index in range(len(views))]
        self.views, self.targets = views, targets

    def store(self, indices: range) -> None:
        ok = self.client.store([self.keys[i] for i in indices], [self.views[i] for i in indices])
        assert all(ok), "a store failed"

    def load(self, indices: range) -> None:
        keys = [self.keys[i] for i in indices]
        self.lookup(keys)
        self.load_locked(keys, [self.targets[i] for i in indices])

    def lookup(self, keys: list[ObjectKey]) -> None:
        found = self.client.lookup_and_lock(keys)
        assert all(found.found), "a lookup missed"

    def load_locked(self, keys: list[ObjectKey], targets: list[memoryview]) -> None:
        try:
            ok = self.client.load(keys, targets)
        finally:
            self.adapter.unlock(keys)
        assert all(ok), "a load failed"

    def store_one(self, index: int) -> None:
        self.store(range(index, index + 1))

    def load_one(self, index: int) -> None:
        self.load(range(index, index + 1))

    def load_one_looked_up(self, index: int) -> Callable[[], None]:
        """The lookup of object ``index`` done; the load left to time."""
        keys = [self.keys[index]]
        self.lookup(keys)
        return lambda: self.load_locked(keys, [self.targets[index]])

    def clear(self) -> None:
        self.adapter.delete(self.keys)


def timed(step: Callable[[range], None], count: int, batch: int) -> float:
    started = time.perf_counter()
    for start in range(0, count, batch):
        step(range(start, min(count, start + batch)))
    return time.perf_counter() - started


def elapsed(step: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    step(*args)
    return time.perf_counter() - started


def wiped(view: memoryview) -> None:
    np.frombuffer(view, dtype=np.uint8)[:] = 0


def check_loaded(what: str, loaded: memoryview, stored: memoryview) -> None:
    """Stop the run unless a timed load wrote the stored bytes: a load that reports success
    and writes nothing is a failure, not a fast load (unlike an ``assert``, this check
    stays under ``python -O``)."""
    if not np.array_equal(np.frombuffer(loaded, dtype=np.uint8), np.frombuffer(stored, dtype=np.uint8)):
        raise SystemExit(f"{what} loaded other bytes than were stored")


def verified(
    who: str, method: Direct | ThroughAdapter, index: int, load: Callable[..., object], *args: object
) -> float:
    """Seconds of ``load(*args)``, a load of object ``index``, then (untimed) its
    destination checked against the stored bytes and zeroed again.  Zeroed after the check
    rather than right before the next load into it, which would bring the destination
    into the CPU's cache that the loads' spacing keeps it out of (``one_at_a_time``)."""
    seconds = elapsed(load, *args)
    check_loaded(f"{who} of object {index}", method.targets[index], method.views[index])
    wiped(method.targets[index])
    return seconds


def one_at_a_time(
    direct: Direct,
    through: ThroughAdapter,
    count: int,
    rounds: dict[str, dict[str, list[float]]],
    number: int,
) -> None:
    """Per-object latencies of round ``number``: stores one method after the other (who
    goes first alternates from round to round), each method's objects deleted before the
    other's stores, then loads interleaved object by object, so that a shared machine's
    drift hits both alike.

    Stores are timed one method after the other, each into memory the server just freed
    of the other's objects: a store's value is the request's own buffer on both sides (a
    ``SET``), and each side then pays the same page faults for it.  (The adapter once
    stored a hash, whose ``HSET`` copies the value out of the request's buffer and frees
    that buffer, which a ``SET`` sent right after took over: interleaved object by object,
    ~0.5 ms of page faults per MiB moved from one side's latency to the other's.)"""
    stores = [("redis-py", direct), ("adapter", through)]
    for name, method in stores if number % 2 else stores[::-1]:
        for index in range(count):
            rounds[name]["store_lat"].append(elapsed(method.store_one, index))
        method.clear()
    direct.store(range(count))  # the objects the loads read, stored untimed
    through.store(range(count))
    # Every load finds its destination zeroed: by this, then by the check of the load
    # before it into the same buffer (``verified``).
    for method in (direct, through):
        for target in method.targets:
            wiped(target)
    # Each of the three timed loads writes another object's buffer (a third of the objects
    # apart), so none lands in a buffer the one before just left in the CPU's cache.
    ours, theirs = rounds["adapter"], rounds["redis-py"]
    for step in range(count):
        got, fetched, loaded = step, (step + count // 3) % count, (step + 2 * count // 3) % count
        if step % 2:
            get = verified("redis-py's GET", direct, got, direct.load_one, got)
        ours["fetch_lat"].append(
            verified("the adapter's lookup+load", through, fetched, through.load_one, fetched)
        )
        ours["load_lat"].append(
            verified("the adapter's load", through, loaded, through.load_one_looked_up(loaded))
        )
        if not step % 2:
            get = verified("redis-py's GET", direct, got, direct.load_one, got)
        theirs["fetch_lat"].append(get)
        theirs["load_lat"].append(get)  # a GET is redis-py's load and its whole fetch


def run(objects: int, size: int, batch: int, repeat: int) -> dict[str, dict[str, float]]:
    source, dest = arena(objects * size), arena(objects * size)
    source[:] = np.random.default_rng(1).integers(0, 256, objects * size, dtype=np.uint8).tobytes()
    views = [source[i * size : (i + 1) * size] for i in range(objects)]
    targets = [dest[i * size : (i + 1) * size] for i in range(objects)]
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory:
        server = RedisServer(Path(directory)).start()
        try:
            config = RedisConfig(url=server.url, key_prefix=f"bench-{uuid.uuid4().hex[:6]}:")
            registry = load_registry()
            adapter = create_adapter(
                registry.get(Kind.L2_ADAPTER, "redis").load(),
                config,
                AdapterContext(index=0, name="0:redis", config=config, l1_buffer=source),
                registry=registry,
                type_name="redis",
            )
            methods: dict[str, Direct | ThroughAdapter] = {
                "redis-py": Direct(server.url, views, targets, config.pipeline_max_bytes),
                "redis-py/batch": Direct(server.url, views, targets, batch * size, prefix="batch"),
                "adapter": ThroughAdapter(adapter, views, targets),
            }
            rounds: dict[str, dict[str, list[float]]] = {
                name: {"store": [], "load": [], "store_lat": [], "load_lat": [], "fetch_lat": []}
                for name in methods
            }
            direct, through = methods["redis-py"], methods["adapter"]
            assert isinstance(direct, Direct) and isinstance(through, ThroughAdapter)
            for number in range(repeat):
                for name, method in round_order(list(methods.items()), number):
                    rounds[name]["store"].append(objects * size / timed(method.store, objects, batch) / 1e9)
                    wiped(dest)  # a load must write every byte
                    rounds[name]["load"].append(objects * size / timed(method.load, objects, batch) / 1e9)
                    check_loaded(f"{name}'s batch load", dest, source)
                    # Every method's stores find the server as redis-py's do, its memory the
                    # one before just freed (see the docstring).
                    method.clear()
                one_at_a_time(direct, through, objects, rounds, number)
                for method in methods.values():
                    method.clear()
            adapter.close()
        finally:
            server.stop()
    results: dict[str, dict[str, float]] = {}
    for name, data in rounds.items():
        if not data["store_lat"]:  # a throughput-only baseline
            results[name] = {
                kind: statistics.median(data[kind.removesuffix("_gbps")])
                for kind in ("store_gbps", "load_gbps")
            }
            continue
        results[name] = {
            "store_gbps": statistics.median(data["store"]),
            "load_gbps": statistics.median(data["load"]),
            "store_p50_ms": percentile(data["store_lat"], 0.5) * 1e3,
            "store_p99_ms": percentile(data["store_lat"], 0.99) * 1e3,
            "load_p50_ms": percentile(data["load_lat"], 0.5) * 1e3,
            "load_p99_ms": percentile(data["load_lat"], 0.99) * 1e3,
            "fetch_p50_ms": percentile(data["fetch_lat"], 0.5) * 1e3,
            "fetch_p99_ms": percentile(data["fetch_lat"], 0.99) * 1e3,
        }
    ours, theirs = results["adapter"], results["redis-py"]
    for kind in ("store", "load"):
        for baseline, suffix in (("redis-py", ""), ("redis-py/batch", "_batch")):
            pairs = zip(rounds["adapter"][kind], rounds[baseline][kind], strict=True)
            ours[f"{kind}_ratio{suffix}"] = statistics.median(a / d for a, d in pairs)
    # Latency ratios: redis-py's latency over the adapter's, so >= 0.8 means "at most 1.25x".
    for row in ("store", "load", "fetch"):
        for cut in ("p50", "p99"):
            ours[f"{row}_{cut}_ratio"] = theirs[f"{row}_{cut}_ms"] / ours[f"{row}_{cut}_ms"]
    return results


def main() -> None:
    parser = BenchParser(__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reason = missing_reason()
    if reason is not None:
        raise SystemExit(f"cannot run: {reason}")
    size = int(args.size_mib * (1 << 20))
    results = run(args.objects, size, args.batch, args.repeat)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    heading = (
        f"{args.objects} x {args.size_mib:g} MiB, batches of {args.batch}, median of {args.repeat} rounds"
    )
    print(heading)
    print(f"{'method':<14} {'store GB/s':>10} {'load GB/s':>10}")
    for name, row in results.items():
        print(f"{name:<14} {row['store_gbps']:>10.2f} {row['load_gbps']:>10.2f}")
    ours, theirs = results["adapter"], results["redis-py"]
    print(
        f"adapter / redis-py throughput: store {ours['store_ratio']:.2f}x, "
        f"load {ours['load_ratio']:.2f}x (target >= 0.8x)"
    )
    print(
        f"adapter / redis-py/batch throughput: store {ours['store_ratio_batch']:.2f}x, "
        f"load {ours['load_ratio_batch']:.2f}x (a baseline with more in flight than the adapter)"
    )
    print("per-object latency, one object at a time, ms (redis-py: SET / GET + copy into the arena)")
    print(f"{'':<28} {'redis-py p50/p99':>17} {'adapter p50/p99':>17} {'ratio p50/p99':>15}")
    rows = (
        ("store", "store (SET | store task)"),
        ("load", "load (GET | load task)"),
        ("fetch", "fetch (GET | lookup+load)"),
    )
    for row, label in rows:
        print(
            f"{label:<28}"
            f" {theirs[f'{row}_p50_ms']:>8.2f}/{theirs[f'{row}_p99_ms']:<8.2f}"
            f" {ours[f'{row}_p50_ms']:>8.2f}/{ours[f'{row}_p99_ms']:<8.2f}"
            f" {ours[f'{row}_p50_ratio']:>6.2f}x/{ours[f'{row}_p99_ratio']:.2f}x"
        )
    print("latency ratio = redis-py's / the adapter's (target >= 0.8x: at most 1.25x redis-py's)")


if __name__ == "__main__":
    main()
