"""The benchmarks that time loads check the bytes of every timed load against what was
stored: a load that reports success but writes nothing must stop the run, not be timed as
a fast one.  The buffers a load writes into are wiped before it, so that bytes an earlier
load (or the other side of a comparison) left there cannot pass for its own."""

from __future__ import annotations

import itertools
import types
from typing import Any

import numpy as np
import pytest
from bench_modules import load_bench

# -- bench_workload ---------------------------------------------------------------------------


def test_a_workload_retrieve_that_writes_nothing_after_the_first_stops_the_run(monkeypatch) -> None:
    """Every request stores the same bytes, and the lookup's floor copies them into the
    retrieve's buffers: a retrieve that wrote nothing found the last request's bytes there
    and passed the byte check."""
    bench_workload = load_bench("bench_workload")
    retrieves = itertools.count()

    class FakeProc:
        pid = 12345

        def send_signal(self, number: int) -> None:
            pass

        def wait(self, timeout: float) -> int:
            return 0

    class FakeClient:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.stored: list[np.ndarray[Any, Any]] = []

        def status(self) -> dict[str, Any]:
            return {"server": {}}

        def store(self, keys: list, sources: list, layouts: list) -> int:
            self.stored = [np.array(source) for source in sources]
            return len(keys)

        def lookup(self, keys: list) -> int:
            return len(keys)

        def retrieve_into(self, keys: list, targets: list) -> int:
            if next(retrieves) == 0:  # the first one right, then nothing written
                for stored, target in zip(self.stored, targets, strict=True):
                    np.copyto(target, stored)
            return len(keys)

        def evict(self, keys: list) -> int:
            return len(keys)

        def close(self) -> None:
            pass

    class CopyingFloor:
        """The floor's placement (a copy of the request's bytes into the same buffers),
        without its round trip."""

        samples: list[float] = []

        def measure(self, request: bytes, sources: list, targets: list) -> None:
            for source, target in zip(sources, targets, strict=True):
                np.copyto(target, source)

    monkeypatch.setattr(bench_workload, "start_server", lambda *args: (FakeProc(), "tcp://127.0.0.1:1"))
    monkeypatch.setattr(bench_workload, "Client", FakeClient)
    shape = bench_workload.Shape(requests=3, tokens=32, chunk_tokens=16, bytes_per_token=64)
    with pytest.raises(SystemExit, match="retrieved bytes differ"):
        bench_workload._run_scenario("warm", shape, 1, "fs", "tcp", False, None, None, CopyingFloor())


# -- bench_mooncake ---------------------------------------------------------------------------

SIZE = 4096
COUNT = 4


class MooncakeDirect:
    """Mooncake's client, as bench_mooncake's ``Direct`` drives it: its reads write the
    stored bytes."""

    def __init__(self, src: memoryview, dst: memoryview) -> None:
        self.src, self.dst = src, dst

    def get_batch(self, names: list[str], size: int) -> None:
        self.dst[:] = self.src

    def get_one(self, name: str, index: int, size: int) -> None:
        self.dst[index * size : (index + 1) * size] = self.src[index * size : (index + 1) * size]

    def exists_and_get(self, names: list[str], size: int) -> None:
        self.get_batch(names, size)

    def put_batch(self, names: list[str], size: int) -> None:
        pass

    def put_records(self, names: list[str], size: int) -> None:
        pass

    def get_records(self, names: list[str], size: int) -> None:
        pass

    def put_one(self, name: str, index: int, size: int) -> None:
        pass

    def exists(self, names: list[str]) -> None:
        pass

    def remove(self, names: list[str]) -> None:
        pass


class SilentAdapter:
    """An adapter whose loads report success and write nothing."""

    def __init__(self) -> None:
        outer = self

        class Found:
            def __init__(self, count: int) -> None:
                self.found = [True] * count

        class BlockingClient:
            def lookup_and_lock(self, keys: list) -> Found:
                return Found(len(keys))

            def store(self, keys: list, views: list) -> list[bool]:
                return [True] * len(keys)

            def load(self, keys: list, views: list) -> list[bool]:
                return [True] * len(keys)

        self.client = BlockingClient()
        self.adapter = outer

    def store(self, keys: list, views: list) -> None:
        pass

    def load(self, keys: list, views: list) -> None:
        pass

    def load_only(self, keys: list, views: list) -> None:
        pass

    def lookup(self, keys: list) -> None:
        pass

    def unlock(self, keys: list) -> None:
        pass

    def delete(self, keys: list) -> None:
        pass


def mooncake_buffers() -> tuple[memoryview, memoryview]:
    src = memoryview(bytearray(np.random.default_rng(3).integers(0, 256, COUNT * SIZE, dtype=np.uint8)))
    return src, memoryview(bytearray(COUNT * SIZE))


@pytest.mark.parametrize("tag", ["r0", "r1"])  # the client first, then the adapter first
def test_a_mooncake_batch_load_that_writes_nothing_stops_the_run(tag: str) -> None:
    """The destination was never wiped between the methods: the client's read left the
    stored bytes there, and the one check, after both, passed an adapter load that wrote
    nothing."""
    pytest.importorskip("lmcache_plugin_mooncake")
    bench_mooncake = load_bench("bench_mooncake")
    src, dst = mooncake_buffers()
    direct = MooncakeDirect(src, dst)
    with pytest.raises(SystemExit, match="adapter"):
        bench_mooncake.batch_round(tag, direct, SilentAdapter(), src, dst, SIZE, COUNT)


def test_a_mooncake_single_object_load_that_writes_nothing_stops_the_run() -> None:
    """The per-object loads were not checked at all."""
    pytest.importorskip("lmcache_plugin_mooncake")
    bench_mooncake = load_bench("bench_mooncake")
    src, dst = mooncake_buffers()
    with pytest.raises(SystemExit, match="adapter"):
        bench_mooncake.latency_round("r0", MooncakeDirect(src, dst), SilentAdapter(), src, dst, SIZE, COUNT)


# -- bench_s3 ---------------------------------------------------------------------------------


class S3Direct:
    """s3fs, as bench_s3's ``Direct`` drives it: what it puts it gets back."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_all(self, names: list[str], sources: list[memoryview]) -> None:
        self.objects.update((name, bytes(source)) for name, source in zip(names, sources, strict=True))

    def get_all(self, names: list[str], targets: list[memoryview]) -> None:
        for name, target in zip(names, targets, strict=True):
            target[:] = self.objects[name]

    def head(self, name: str) -> None:
        if name not in self.objects:  # a miss raises, as head_object's does
            raise FileNotFoundError(name)

    def delete_all(self, names: list[str]) -> None:
        for name in names:
            self.objects.pop(name, None)


class S3Client:
    """The adapter's blocking client: ``stores`` and ``loads`` say what its calls report;
    its loads write nothing."""

    def __init__(self, stores: bool = True) -> None:
        self.stores = stores

    def store(self, keys: list, sources: list) -> list[bool]:
        return [self.stores] * len(keys)

    def lookup_and_lock(self, keys: list) -> Any:
        class Found:
            found = [self.stores] * len(keys)

        return Found()

    def load(self, keys: list, targets: list) -> list[bool]:
        return [self.stores] * len(keys)


class S3Adapter:
    def unlock(self, keys: list) -> None:
        pass

    def delete(self, keys: list) -> None:
        pass


@pytest.mark.parametrize(("stores", "says"), [(True, "loaded other bytes"), (False, "adapter store failed")])
def test_an_s3_single_object_round_trip_that_fails_or_writes_nothing_stops_the_run(
    stores: bool, says: str
) -> None:
    """The adapter's per-object store, lookup and load were timed without looking at what
    they returned, and the load wrote where the direct client's read had just written the
    same bytes: a failed store (then a miss, then a failed load) was timed as three fast
    operations."""
    pytest.importorskip("lmcache_plugin_s3")
    bench_s3 = load_bench("bench_s3")
    arena = bench_s3.Arena(4, SIZE)
    with pytest.raises(SystemExit, match=says):
        bench_s3.measure_latency(S3Direct(), S3Adapter(), S3Client(stores), arena, 4)


def test_both_s3_methods_store_before_the_first_timed_round(monkeypatch) -> None:
    """A fresh S3 server's first writes ran several times slower than later ones, and fell
    on whichever method went first in the first round (the direct client: its first
    round's store ratio was 2x where the others' were 0.7-0.9x)."""
    pytest.importorskip("lmcache_plugin_s3")
    bench_s3 = load_bench("bench_s3")
    calls: list[str] = []
    direct = S3Direct()
    client = S3Client()

    class Recorded:
        def __init__(self, name: str, call: Any) -> None:
            self.name, self.call = name, call

        def __call__(self, *args: Any) -> Any:
            calls.append(self.name)
            return self.call(*args)

    direct.put_all = Recorded("direct store", direct.put_all)  # type: ignore[method-assign]
    client.store = Recorded("adapter store", client.store)  # type: ignore[method-assign]
    real_timed = bench_s3.timed

    def timed(action: Any, *args: Any) -> float:
        calls.append("timed")
        return real_timed(action, *args)

    class Args:
        repeat, inflight, latency_objects = 1, 1, 0

    monkeypatch.setattr(bench_s3, "Loop", lambda: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(
        bench_s3,
        "Direct",
        lambda *args: types.SimpleNamespace(
            put_all=direct.put_all,
            get_all=lambda names, targets: None,
            delete_all=direct.delete_all,
            close=lambda: None,
        ),
    )
    monkeypatch.setattr(
        bench_s3,
        "open_adapter",
        lambda *args: types.SimpleNamespace(
            delete=lambda keys: None,
            close=lambda: None,
            unlock=lambda keys: None,
        ),
    )
    monkeypatch.setattr(bench_s3, "BlockingAdapterClient", lambda *args, **kwargs: client)
    monkeypatch.setattr(bench_s3, "timed", timed)
    monkeypatch.setattr(bench_s3.Arena, "verify", lambda self: None)  # the loads here write nothing
    unmeasured = {op: (0.0, 0.0) for op in ("store", "load", "lookup")}
    monkeypatch.setattr(
        bench_s3, "measure_latency", lambda *args: {"s3fs direct": unmeasured, "s3 adapter": unmeasured}
    )
    bench_s3.run_case(2, SIZE, Args(), None)
    first_timed = calls.index("timed")
    assert {"direct store", "adapter store"} <= set(calls[:first_timed]), calls


# -- bench_server -----------------------------------------------------------------------------


def test_a_bare_lookup_answered_with_an_error_or_misses_stops_the_run() -> None:
    """bench_server's bare DEALER rounds timed the server's replies without decoding them:
    a LOOKUP the server refused (an error reply, faster than a lookup) was timed as the
    server's share of a round trip."""
    from lmcache_tiers.wire import protocol as p

    bench_server = load_bench("bench_server")
    refused = p.encode(p.ErrorReply(2, p.ErrorCode.MALFORMED.value, "no"))
    with pytest.raises(SystemExit, match="answered"):
        bench_server.check_bare_lookup(refused, 16)
    with pytest.raises(SystemExit, match="answered"):
        bench_server.check_bare_lookup(p.encode(p.LookupReply(2, handle=1, hits=3)), 16)
    bench_server.check_bare_lookup(p.encode(p.LookupReply(2, handle=1, hits=16)), 16)


# -- bench_redis ------------------------------------------------------------------------------


class RedisSide:
    """bench_redis's ``Direct`` or ``ThroughAdapter`` as ``one_at_a_time`` drives it: its
    stores keep nothing, its loads write the stored bytes unless ``silent`` names them
    (``load_one``: redis-py's GET or the adapter's lookup+load; ``looked_up``: the
    adapter's load after an untimed lookup)."""

    def __init__(self, views: list[memoryview], targets: list[memoryview], silent: str = "") -> None:
        self.views, self.targets, self.silent = views, targets, silent

    def store_one(self, index: int) -> None:
        pass

    def store(self, indices: range) -> None:
        pass

    def clear(self) -> None:
        pass

    def load_one(self, index: int) -> None:
        if self.silent != "load_one":
            self.targets[index][:] = self.views[index]

    def load_one_looked_up(self, index: int) -> Any:
        def load() -> None:
            if self.silent != "looked_up":
                self.targets[index][:] = self.views[index]

        return load


@pytest.mark.parametrize(
    ("silent_side", "silent", "says"),
    [
        ("adapter", "load_one", "adapter's lookup\\+load of object"),
        ("adapter", "looked_up", "adapter's load of object"),
        ("redis-py", "load_one", "redis-py's GET of object"),
    ],
)
def test_a_redis_single_object_load_that_writes_nothing_stops_the_run(
    silent_side: str, silent: str, says: str
) -> None:
    """The per-object loads were timed and never compared: every load of a round wrote
    into the one destination all three kinds of load share, so a load that wrote nothing
    found the bytes an earlier load of the same object had left there, and the one
    untimed pass after the round (the adapter's, writing all of them) saw nothing amiss."""
    pytest.importorskip("lmcache_plugin_redis")
    bench_redis = load_bench("bench_redis")
    count = 6
    source = np.random.default_rng(5).integers(0, 256, count * SIZE, dtype=np.uint8).tobytes()
    views = [memoryview(source)[i * SIZE : (i + 1) * SIZE] for i in range(count)]
    dest = memoryview(bytearray(count * SIZE))
    targets = [dest[i * SIZE : (i + 1) * SIZE] for i in range(count)]
    dest[:] = source  # what an earlier round's loads left there
    direct = RedisSide(views, targets, silent if silent_side == "redis-py" else "")
    through = RedisSide(views, targets, silent if silent_side == "adapter" else "")
    rounds = {name: {"store_lat": [], "load_lat": [], "fetch_lat": []} for name in ("redis-py", "adapter")}
    with pytest.raises(SystemExit, match=says):
        bench_redis.one_at_a_time(direct, through, count, rounds, 0)


def test_redis_single_object_loads_that_write_the_stored_bytes_are_timed() -> None:
    pytest.importorskip("lmcache_plugin_redis")
    bench_redis = load_bench("bench_redis")
    count = 6
    source = np.random.default_rng(5).integers(0, 256, count * SIZE, dtype=np.uint8).tobytes()
    views = [memoryview(source)[i * SIZE : (i + 1) * SIZE] for i in range(count)]
    dest = memoryview(bytearray(count * SIZE))
    targets = [dest[i * SIZE : (i + 1) * SIZE] for i in range(count)]
    rounds = {name: {"store_lat": [], "load_lat": [], "fetch_lat": []} for name in ("redis-py", "adapter")}
    bench_redis.one_at_a_time(RedisSide(views, targets), RedisSide(views, targets), count, rounds, 0)
    assert all(len(samples) == count for side in rounds.values() for samples in side.values())
