"""Client-side benchmark of a running server (``lmcache-tiers bench``, ``bench/bench_server.py``).

Each throughput figure is reported next to the limit measured in the same run on the same
bytes: a plain memcpy (numpy copy between two pre-faulted buffers) of the N x S chunks.
STORE through shared memory is reserve + one copy into the arena + commit; RETRIEVE is
read-lock + one copy out of the arena into pre-faulted buffers + release, so their ratio to
memcpy is the cost of the protocol.  Inline mode moves the same bytes through the socket.
Every chunk retrieved, and every timed store (read back untimed), is compared with the
bytes stored: a figure is never reported for wrong bytes.
LOOKUP latency is the round trip of one request naming ``lookup_keys`` keys that are all in
L1, measured one request at a time from one client.

The benchmark is safe to run against a server in production: its keys carry a cache salt
of their own (no engine's key can collide with them, and engines' lookups never see
them), they are stored L1-only (nothing is written to, or evicted from, any L2 adapter),
and every key it stored is deleted from L1 (EVICT) when it is done, also after a failure
or Ctrl-C (when the server no longer answers, the failure says how many it could not delete).
It only needs L1 room for one batch; an engine's L1 objects may be evicted to make that
room, exactly as a burst of stores would.  A server without these protocol features is
refused rather than measured, and so is a batch larger than the server's L1 or than this
machine's memory can hold twice (the chunks and the buffers they are retrieved into),
before anything is allocated.
"""

from __future__ import annotations

import logging
import os
import secrets
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.replay.run import percentile
from lmcache_tiers.server.preflight import mem_available

#: model name of every benchmark key; the cache salt is new per run
BENCH_MODEL = "lmcache-tiers-bench"
#: protocol features a server must have for the benchmark to leave nothing behind
REQUIRED_FEATURES = ("l1_only_store", "evict")
logger = logging.getLogger(__name__)

#: how long a failed run waits for the server to answer before it tries to clean up
CLEANUP_PING_TIMEOUT_S = 2.0


@dataclass
class BenchResult:
    url: str
    chunks: int
    chunk_bytes: int
    repeats: int
    shm: bool
    memcpy_gbps: float = 0.0
    store_gbps: float | None = None
    retrieve_gbps: float | None = None
    inline_store_gbps: float | None = None
    inline_retrieve_gbps: float | None = None
    lookup_keys: int = 0
    lookup_requests: int = 0
    lookup_p50_us: float = 0.0
    lookup_p99_us: float = 0.0
    lookup_per_s: float = 0.0  # one request at a time
    lookup_window: int = 0
    lookup_pipelined_per_s: float = 0.0  # ``lookup_window`` requests in flight
    ping_p50_us: float = 0.0
    cache_salt: str = ""
    #: objects the benchmark stored and then deleted again (all of them, unless a note says)
    objects_removed: int = 0
    notes: list[str] = field(default_factory=list)

    def ratio(self, value: float | None) -> float | None:
        return None if value is None or not self.memcpy_gbps else value / self.memcpy_gbps

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("store_gbps", "retrieve_gbps", "inline_store_gbps", "inline_retrieve_gbps"):
            data[name.replace("_gbps", "_vs_memcpy")] = self.ratio(getattr(self, name))
        return data


Step = Callable[[str], None]

_GIB = float(1 << 30)


class BenchSizeError(ValueError):
    """A batch that does not fit the server's L1 or this machine's memory."""


def check_batch_room(client: Client, chunks: int, chunk_bytes: int) -> None:
    """Raise BenchSizeError unless one batch fits the server's L1 and two fit in the memory
    this machine has available (the chunks stored, and the buffers retrieved into)."""
    batch = chunks * chunk_bytes
    shown = f"one batch of {chunks} chunks of {chunk_bytes / (1 << 20):g} MiB ({batch / _GIB:.2f} GiB)"
    capacity = int(client.status().get("l1", {}).get("capacity_bytes") or 0)
    if capacity and batch > capacity:
        raise BenchSizeError(f"{shown} does not fit the server's L1 ({capacity / _GIB:.2f} GiB)")
    available = mem_available()
    if available is not None and 2 * batch > available:
        raise BenchSizeError(
            f"{shown} is held twice in this process, and this machine has {available / _GIB:.2f} GiB "
            "of memory available (MemAvailable)"
        )


class BenchKeys:
    """Keys of one benchmark run under its own salt, and which of them are on the server."""

    def __init__(self) -> None:
        self.salt = f"bench-{os.getpid()}-{secrets.token_hex(6)}"
        self.stored: list[ObjectKey] = []  # on the server now
        self.removed = 0  # stored and deleted again
        self.read_locked: list[ObjectKey] = []  # looked up, not released yet: EVICT skips them

    def make(self, tag: str, count: int) -> list[ObjectKey]:
        return [
            ObjectKey(BENCH_MODEL, 0, tag.encode() + index.to_bytes(4, "big"), 0, self.salt)
            for index in range(count)
        ]

    def store(self, client: Client, keys: list[ObjectKey], buffers: list[Any]) -> int:
        self.stored.extend(keys)
        return client.store(keys, buffers, l1_only=True)

    def remove(self, client: Client, keys: list[ObjectKey] | None = None) -> int:
        """EVICT ``keys`` (default: every key stored so far) and forget them."""
        chosen = list(self.stored if keys is None else keys)
        removed = client.evict(chosen) if chosen else 0
        gone = set(chosen)
        self.stored = [key for key in self.stored if key not in gone]
        self.removed += removed
        return removed


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


@contextmanager
def _timed(samples: list[float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    samples.append(time.perf_counter() - start)


def run_bench(
    url: str,
    *,
    chunks: int = 64,
    chunk_bytes: int = 2 << 20,
    repeats: int = 5,
    lookup_keys: int = 16,
    lookup_requests: int = 20_000,
    inline: bool = True,
    auth_token: str | None = None,
    timeout: float = 60.0,
    step: Step | None = None,
) -> BenchResult:
    """Measure one server; ``step(label)`` is called after each unit of work (progress)."""
    tick: Step = step or (lambda label: None)
    with Client(url, auth_token=auth_token, timeout=timeout, name="bench") as client:
        missing = [name for name in REQUIRED_FEATURES if name not in client.server_features]
        if missing:
            raise RuntimeError(
                f"the server lacks {', '.join(missing)} (it is older than this client), so the "
                "benchmark could not keep its objects out of L2 and delete them afterwards"
            )
        check_batch_room(client, chunks, chunk_bytes)
        rng = np.random.default_rng(1234)
        sources = [rng.integers(0, 256, chunk_bytes, dtype=np.uint8) for _ in range(chunks)]
        targets = [np.ones(chunk_bytes, dtype=np.uint8) for _ in range(chunks)]  # pre-faulted
        bench_keys = BenchKeys()
        result = BenchResult(url, chunks, chunk_bytes, repeats, client.uses_shm, cache_salt=bench_keys.salt)
        if not client.uses_shm:
            result.notes.append("shared memory unavailable from here: the default mode is inline")
        try:
            _memcpy(result, sources, targets, tick)
            modes: list[tuple[Client, str]] = [(client, "shm" if client.uses_shm else "inline")]
            if inline and client.uses_shm:
                inline_client = Client(
                    url, auth_token=auth_token, timeout=timeout, shm=False, name="bench-inline"
                )
                modes.append((inline_client, "inline"))
            try:
                for mode_client, mode in modes:
                    figures = _throughput(mode_client, bench_keys, mode, sources, targets, repeats, tick)
                    if mode == "shm":
                        result.store_gbps, result.retrieve_gbps = figures
                    else:
                        result.inline_store_gbps, result.inline_retrieve_gbps = figures
            finally:
                for mode_client, _mode in modes[1:]:
                    mode_client.close()
            _latency(client, bench_keys, result, lookup_keys, lookup_requests, tick)
        except BaseException as failure:
            # Ctrl-C too: a run stopped by hand must not leave its batch in a production L1.
            left_behind = _remove_after_failure(client, bench_keys, timeout)
            if left_behind is None:
                raise
            if not isinstance(failure, Exception):
                # The CLI ends an interrupted run (exit 130) without printing the interrupt
                # or its notes: what stays on the server is said in a log line of its own.
                logger.warning("benchmark interrupted: %s", left_behind)
                failure.add_note(left_behind)
                raise
            # The run's own failure first, then what it leaves on the server.
            raise RuntimeError(f"{failure}; {left_behind}") from failure
        _remove_everything(client, bench_keys, result)
    return result


def _remove_after_failure(client: Client, bench_keys: BenchKeys, timeout: float) -> str | None:
    """After a failed run, delete what it stored; None when done, else why not.

    A server that does not answer a PING soon (it died, or the link dropped) is not
    waited for again for each clean-up request: the failure is reported at once."""
    left = len(bench_keys.stored)
    if not left:
        return None
    try:
        client.ping(timeout=min(timeout, CLEANUP_PING_TIMEOUT_S))
        if bench_keys.read_locked:
            client.release(bench_keys.read_locked)
            bench_keys.read_locked = []
        bench_keys.remove(client)
    except ClientError as exc:
        return (
            f"the {left} benchmark objects still in L1 could not be deleted ({exc}); "
            "they are L1-only (never in L2) and go when evicted or when the server stops"
        )
    return None


def _remove_everything(client: Client, bench_keys: BenchKeys, result: BenchResult) -> None:
    """Delete what is left of the run's objects, and say so if some could not be."""
    left = len(bench_keys.stored)
    try:
        removed = bench_keys.remove(client)
    except ClientError as exc:
        result.notes.append(f"could not delete {left} benchmark objects from L1: {exc}")
        return
    result.objects_removed = bench_keys.removed
    if removed < left:
        result.notes.append(
            f"{left - removed} benchmark objects were still locked; they stay in L1 "
            "(never in L2) until evicted"
        )


def _memcpy(
    result: BenchResult, sources: list[np.ndarray[Any, Any]], targets: list[np.ndarray[Any, Any]], tick: Step
) -> None:
    copies: list[float] = []
    for _ in range(result.repeats):
        with _timed(copies):
            for source, target in zip(sources, targets, strict=True):
                np.copyto(target, source)
        tick("memcpy")
    result.memcpy_gbps = _gbps(result.chunks * result.chunk_bytes, statistics.median(copies))


def _throughput(
    client: Client,
    bench_keys: BenchKeys,
    mode: str,
    sources: list[np.ndarray[Any, Any]],
    targets: list[np.ndarray[Any, Any]],
    repeats: int,
    tick: Step,
) -> tuple[float, float]:
    total = sum(source.nbytes for source in sources)
    stores: list[float] = []
    keys: list[ObjectKey] = []
    for repeat in range(repeats):
        if keys:
            # Read back (untimed) before its keys make room: a figure is never reported
            # for a store that kept other bytes, even when the last store kept the right ones.
            _retrieve_checked(client, f"{mode} STORE {repeat}/{repeats}:", keys, sources, targets)
            bench_keys.remove(client, keys)  # make room; the timed store below writes fresh keys
        keys = bench_keys.make(f"{mode}{repeat}", len(sources))
        with _timed(stores):
            stored = bench_keys.store(client, keys, sources)
        if stored != len(keys):
            raise RuntimeError(f"{mode} STORE stored {stored} of {len(keys)} chunks (L1 too small?)")
        tick(f"{mode} store")
    retrieves: list[float] = []
    for _ in range(repeats):
        _retrieve_checked(client, mode, keys, sources, targets, timings=retrieves)
        tick(f"{mode} retrieve")
    bench_keys.remove(client, keys)
    return _gbps(total, statistics.median(stores)), _gbps(total, statistics.median(retrieves))


def _retrieve_checked(
    client: Client,
    label: str,
    keys: list[ObjectKey],
    sources: list[np.ndarray[Any, Any]],
    targets: list[np.ndarray[Any, Any]],
    timings: list[float] | None = None,
) -> None:
    """RETRIEVE ``keys`` into ``targets`` and fail the run unless every chunk holds, byte for
    byte, what ``sources`` stored: no throughput is reported for wrong bytes.

    Only the RETRIEVE itself is timed (into ``timings``, when given); the buffers are wiped
    before it, so they cannot pass off an earlier retrieve's bytes, another mode's, as its own."""
    for target in targets:
        target.fill(0)
    with _timed([] if timings is None else timings):
        got = client.retrieve_into(keys, targets)
    if got != len(keys):
        raise RuntimeError(f"{label} RETRIEVE returned {got} of {len(keys)} chunks")
    if any(not np.array_equal(source, target) for source, target in zip(sources, targets, strict=True)):
        raise RuntimeError(f"{label} RETRIEVE returned different bytes than were stored")


def _latency(
    client: Client, bench_keys: BenchKeys, result: BenchResult, lookup_keys: int, requests: int, tick: Step
) -> None:
    keys = bench_keys.make("lookup", lookup_keys)
    bench_keys.store(client, keys, [np.zeros(4096, dtype=np.uint8)] * lookup_keys)
    pings = []
    for _ in range(1000):
        start = time.perf_counter_ns()
        client.ping()
        pings.append((time.perf_counter_ns() - start) / 1e3)
    # nearest rank, as replay reports them; never None, as there are samples
    result.ping_p50_us = percentile(pings, 0.5) or 0.0

    latencies: list[float] = []
    report_every = max(1, requests // 100)
    # Every lookup read-locks the prefix once for this client; released below, or by the
    # clean-up of a run that fails on the way.
    bench_keys.read_locked = keys
    began = time.perf_counter()
    for index in range(requests):
        start = time.perf_counter_ns()
        hits = client.lookup(keys)
        latencies.append((time.perf_counter_ns() - start) / 1e3)
        if hits != lookup_keys:
            raise RuntimeError(f"LOOKUP found {hits} of {lookup_keys} keys stored in L1")
        if index % report_every == report_every - 1:
            tick("lookup")
    elapsed = time.perf_counter() - began
    # The same requests with a window of them in flight (Client.lookup_many): what one
    # client gets when it looks up several prompts per scheduler step.
    window = 32
    batches = max(1, requests // window)
    began_pipelined = time.perf_counter()
    for _ in range(batches):
        if client.lookup_many([keys] * window) != [lookup_keys] * window:
            raise RuntimeError("pipelined LOOKUP did not find every key stored in L1")
    pipelined = time.perf_counter() - began_pipelined
    tick("lookup (pipelined)")
    client.release(keys)
    bench_keys.read_locked = []
    result.lookup_keys = lookup_keys
    result.lookup_requests = requests
    result.lookup_p50_us = percentile(latencies, 0.5) or 0.0
    result.lookup_p99_us = percentile(latencies, 0.99) or 0.0
    result.lookup_per_s = requests / elapsed
    result.lookup_window = window
    result.lookup_pipelined_per_s = batches * window / pipelined


def steps_for(repeats: int, inline: bool, lookup_requests: int) -> int:
    """How many times ``run_bench`` calls ``step`` (for a progress bar's total)."""
    modes = 2 if inline else 1
    return repeats + modes * 2 * repeats + min(100, lookup_requests) + 1
