"""Client-side benchmark of a running server (``lmcache-tiers bench``, ``bench/bench_server.py``).

Each throughput figure is reported next to the limit measured in the same run on the same
bytes: a plain memcpy (numpy copy between two pre-faulted buffers) of the N x S chunks.
STORE through shared memory is reserve + one copy into the arena + commit; RETRIEVE is
read-lock + one copy out of the arena into pre-faulted buffers + release, so their ratio to
memcpy is the cost of the protocol.  Inline mode moves the same bytes through the socket.
LOOKUP latency is the round trip of one request naming ``lookup_keys`` keys that are all in
L1, measured one request at a time from one client.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey


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
    notes: list[str] = field(default_factory=list)

    def ratio(self, value: float | None) -> float | None:
        return None if value is None or not self.memcpy_gbps else value / self.memcpy_gbps

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("store_gbps", "retrieve_gbps", "inline_store_gbps", "inline_retrieve_gbps"):
            data[name.replace("_gbps", "_vs_memcpy")] = self.ratio(getattr(self, name))
        return data


Step = Callable[[str], None]


def _keys(tag: str, count: int) -> list[ObjectKey]:
    prefix = os.urandom(8)  # distinct per run, so nothing is already stored on the server
    return [ObjectKey("bench", 0, prefix + tag.encode() + index.to_bytes(4, "big")) for index in range(count)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _percentile(sorted_values: list[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


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
    rng = np.random.default_rng(1234)
    sources = [rng.integers(0, 256, chunk_bytes, dtype=np.uint8) for _ in range(chunks)]
    targets = [np.ones(chunk_bytes, dtype=np.uint8) for _ in range(chunks)]  # pre-faulted
    total = chunks * chunk_bytes

    with Client(url, auth_token=auth_token, timeout=timeout, name="bench") as client:
        result = BenchResult(url, chunks, chunk_bytes, repeats, client.uses_shm)
        if not client.uses_shm:
            result.notes.append("shared memory unavailable from here: the default mode is inline")

        copies: list[float] = []
        for _ in range(repeats):
            with _timed(copies):
                for source, target in zip(sources, targets, strict=True):
                    np.copyto(target, source)
            tick("memcpy")
        result.memcpy_gbps = _gbps(total, statistics.median(copies))

        modes: list[tuple[Client, str]] = [(client, "shm" if client.uses_shm else "inline")]
        inline_client: Client | None = None
        if inline and client.uses_shm:
            inline_client = Client(
                url, auth_token=auth_token, timeout=timeout, shm=False, name="bench-inline"
            )
            modes.append((inline_client, "inline"))
        try:
            for mode_client, mode in modes:
                store_gbps, retrieve_gbps = _throughput(mode_client, mode, sources, targets, repeats, tick)
                if mode == "shm":
                    result.store_gbps, result.retrieve_gbps = store_gbps, retrieve_gbps
                else:
                    result.inline_store_gbps, result.inline_retrieve_gbps = store_gbps, retrieve_gbps
        finally:
            if inline_client is not None:
                inline_client.close()

        _latency(client, result, lookup_keys, lookup_requests, tick)
    return result


def _throughput(
    client: Client,
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
            client.clear()  # make room; the timed store below writes fresh keys
        keys = _keys(f"{mode}{repeat}", len(sources))
        with _timed(stores):
            stored = client.store(keys, sources)
        if stored != len(keys):
            raise RuntimeError(f"{mode} STORE stored {stored} of {len(keys)} chunks (L1 too small?)")
        tick(f"{mode} store")
    retrieves: list[float] = []
    for _ in range(repeats):
        with _timed(retrieves):
            got = client.retrieve_into(keys, targets)
        if got != len(keys):
            raise RuntimeError(f"{mode} RETRIEVE returned {got} of {len(keys)} chunks")
        tick(f"{mode} retrieve")
    if any(not np.array_equal(source, target) for source, target in zip(sources, targets, strict=True)):
        raise RuntimeError(f"{mode} RETRIEVE returned different bytes than were stored")
    client.clear()
    return _gbps(total, statistics.median(stores)), _gbps(total, statistics.median(retrieves))


def _latency(client: Client, result: BenchResult, lookup_keys: int, requests: int, tick: Step) -> None:
    keys = _keys("lookup", lookup_keys)
    client.store(keys, [np.zeros(4096, dtype=np.uint8)] * lookup_keys)
    pings = []
    for _ in range(1000):
        start = time.perf_counter_ns()
        client.ping()
        pings.append((time.perf_counter_ns() - start) / 1e3)
    pings.sort()
    result.ping_p50_us = _percentile(pings, 0.5)

    latencies: list[float] = []
    report_every = max(1, requests // 100)
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
    client.release(keys)  # every lookup read-locked the prefix once for this client
    client.clear()
    latencies.sort()
    result.lookup_keys = lookup_keys
    result.lookup_requests = requests
    result.lookup_p50_us = _percentile(latencies, 0.5)
    result.lookup_p99_us = _percentile(latencies, 0.99)
    result.lookup_per_s = requests / elapsed
    result.lookup_window = window
    result.lookup_pipelined_per_s = batches * window / pipelined


def steps_for(repeats: int, inline: bool, lookup_requests: int) -> int:
    """How many times ``run_bench`` calls ``step`` (for a progress bar's total)."""
    modes = 2 if inline else 1
    return repeats + modes * 2 * repeats + min(100, lookup_requests) + 1
