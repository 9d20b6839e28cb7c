"""bench_server.py's STORE figures under real conditions: with L2 write-back running, and
with several client processes at once.  Each figure is next to its limit measured in the
same run.

* :func:`store_under_write_back` -- one client on a server with an L2 adapter: ``repeats``
  STOREs of N x S bytes kept out of L2 (``l1_only``: nothing written back), then
  ``repeats`` STOREs of fresh keys that go to L2, back to back, so the write-back of the
  earlier ones runs while the later ones are stored.  Both as GB/s and as a ratio of a
  memcpy of the same bytes measured by the same process right before; then the time L2
  took to take everything (write-back throughput, for the record): until the server has
  no L2 store pending, after which (untimed) every key stored is evicted from L1 and
  looked up, so that only L2 can answer, and a key L2 does not hold stops the run --
  "nothing pending" is also what a write-back that dropped or failed stores leaves.
  The client's mapping of L1 is populated first, so neither phase pays first touches of
  the segment.
* :func:`store_many_clients` -- ``clients`` processes, each with its own client (its
  mapping of L1 populated, as above, before anything is timed): a memcpy phase (all
  processes copy their chunks at once, after a barrier), then a STORE phase (all store
  at once, after another barrier), per chunk size.  The limit is the memcpy
  phase's aggregate rate: what the memory system gives ``clients`` concurrent copies on
  this machine; each process's probe runs while the others copy too, never while they
  store.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey

MODEL = "bench-server-store"


def _sources(count: int, size: int, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def _memcpy_s(sources: list[np.ndarray[Any, Any]], targets: list[np.ndarray[Any, Any]]) -> float:
    began = time.perf_counter()
    for source, target in zip(sources, targets, strict=True):
        np.copyto(target, source)
    return time.perf_counter() - began


def wait_populated(client: Client, timeout: float = 120.0) -> None:
    """Until the client's mapping of the L1 segment is populated (the background pass it
    starts at connect): a copy into a page never touched before costs a page fault, and a
    figure meant to show what write-back costs must not show first touches instead."""
    segment = getattr(client, "_segment", None)
    if segment is not None:
        segment.pages.wait(timeout)


def _keys(salt: str, tag: str, count: int) -> list[ObjectKey]:
    return [ObjectKey(MODEL, 0, f"{tag}-{index}".encode(), 0, salt) for index in range(count)]


# -- one client, with write-back --------------------------------------------------------------


@dataclass
class WriteBackFigures:
    chunks: int
    chunk_bytes: int
    repeats: int
    memcpy_gbps: float
    l1_only_store_gbps: float
    write_back_store_gbps: float
    l1_only_store_ms: list[float] = field(default_factory=list)
    write_back_store_ms: list[float] = field(default_factory=list)
    drained_s: float = 0.0  # after the last store, until nothing was pending (L2 then held all)
    write_back_gbps: float = 0.0  # bytes written back / (stores + drain) time

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["l1_only_vs_memcpy"] = self.l1_only_store_gbps / self.memcpy_gbps
        data["write_back_vs_memcpy"] = self.write_back_store_gbps / self.memcpy_gbps
        return data


def _pending_l2(client: Client) -> int:
    store = client.status().get("store", {})
    return int(store.get("in_flight_tasks", 0)) + int(store.get("pending_batches", 0))


def check_l2_holds(client: Client, key_lists: list[list[ObjectKey]]) -> None:
    """Stop the run unless L2 holds every key of ``key_lists``, once no L2 store is
    pending: each list is evicted from L1 (which answers a lookup first) and looked up,
    its L2 hits prefetched into L1, their locks released and the keys evicted again."""
    for number, keys in enumerate(key_lists):
        client.evict(keys)
        hits = client.lookup(keys)
        if hits:
            client.release(keys[:hits])
        client.evict(keys)
        if hits != len(keys):
            failures = client.status().get("failures", {})
            raise SystemExit(
                f"write-back drained (no L2 store pending), but L2 held {hits} of {len(keys)} keys "
                f"of STORE {number} (a lookup's hits are a prefix); failures counted: {failures}"
            )


def store_under_write_back(url: str, chunks: int, chunk_bytes: int, repeats: int) -> WriteBackFigures:
    sources = _sources(chunks, chunk_bytes, 11)
    targets = [np.ones_like(source) for source in sources]
    total = chunks * chunk_bytes
    salt = f"store-wb-{os.getpid()}-{secrets.token_hex(4)}"
    with Client(url, timeout=120, name="bench-store-wb") as client:
        wait_populated(client)  # phase A reuses its extents, phase B takes fresh ones
        copies = [_memcpy_s(sources, targets) for _ in range(max(5, repeats))]
        memcpy = total / statistics.median(copies) / 1e9
        l1_only: list[float] = []
        for repeat in range(repeats):
            keys = _keys(salt, f"l1-{repeat}", chunks)
            began = time.perf_counter()
            if client.store(keys, sources, l1_only=True) != chunks:
                raise SystemExit("an L1-only STORE was not stored in full (L1 too small?)")
            l1_only.append(time.perf_counter() - began)
            client.evict(keys)
        written: list[float] = []
        first = time.perf_counter()
        for repeat in range(repeats):
            keys = _keys(salt, f"wb-{repeat}", chunks)
            began = time.perf_counter()
            if client.store(keys, sources) != chunks:
                raise SystemExit("a STORE under write-back was not stored in full (L1 too small?)")
            written.append(time.perf_counter() - began)
        stored = time.perf_counter()
        while _pending_l2(client):
            time.sleep(0.01)
        drained = time.perf_counter()
        check_l2_holds(client, [_keys(salt, f"wb-{repeat}", chunks) for repeat in range(repeats)])
    return WriteBackFigures(
        chunks,
        chunk_bytes,
        repeats,
        memcpy,
        total / statistics.median(l1_only) / 1e9,
        total / statistics.median(written) / 1e9,
        [round(s * 1e3, 2) for s in l1_only],
        [round(s * 1e3, 2) for s in written],
        drained - stored,
        repeats * total / (drained - first) / 1e9,
    )


# -- several client processes ---------------------------------------------------------------


@dataclass
class ClientsRow:
    clients: int
    chunk_bytes: int
    chunks_per_client: int
    memcpy_gbps: float  # aggregate of the concurrent memcpy phase
    store_gbps: float  # aggregate of the concurrent STORE phase
    single_memcpy_gbps: float  # one process alone, before the others start copying

    @property
    def ratio(self) -> float:
        return self.store_gbps / self.memcpy_gbps if self.memcpy_gbps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "store_vs_memcpy": self.ratio}


def _client_process(
    url: str,
    index: int,
    chunk_bytes: int,
    chunks: int,
    repeats: int,
    barrier: Any,
    results: Any,
) -> None:
    sources = _sources(chunks, chunk_bytes, 100 + index)
    targets = [np.ones_like(source) for source in sources]
    salt = f"store-clients-{os.getpid()}-{secrets.token_hex(4)}"
    with Client(url, timeout=120, name=f"bench-client-{index}") as client:
        # Every process set up (its sources made, its mapping of L1 populated: that
        # background pass would compete with the copies) before anything is timed.
        wait_populated(client)
        barrier.wait()
        single = 0.0
        if index == 0:  # alone: the others wait at the barrier
            single = min(_memcpy_s(sources, targets) for _ in range(5))
        spans: dict[str, list[tuple[float, float]]] = {"memcpy": [], "store": []}
        barrier.wait()
        for _ in range(repeats):
            began = time.monotonic()
            _memcpy_s(sources, targets)
            spans["memcpy"].append((began, time.monotonic()))
            barrier.wait()
        for repeat in range(repeats):
            keys = _keys(salt, f"{repeat}", chunks)
            barrier.wait()
            began = time.monotonic()
            if client.store(keys, sources, l1_only=True) != chunks:
                raise SystemExit(f"client {index}: a STORE was not stored in full (L1 too small?)")
            spans["store"].append((began, time.monotonic()))
            barrier.wait()
            client.evict(keys)
    results.put((index, single, spans))


def _aggregate_gbps(all_spans: list[list[tuple[float, float]]], nbytes_per_span: int) -> float:
    """Median over repeats of (bytes every process moved) / (first start to last end)."""
    rates = []
    for repeat in range(len(all_spans[0])):
        spans = [process[repeat] for process in all_spans]
        wall = max(end for _, end in spans) - min(start for start, _ in spans)
        rates.append(len(spans) * nbytes_per_span / wall / 1e9)
    return statistics.median(rates)


def store_many_clients(
    url: str, clients: int, chunk_sizes: list[int], bytes_per_client: int, repeats: int
) -> list[ClientsRow]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for chunk_bytes in chunk_sizes:
        chunks = max(1, bytes_per_client // chunk_bytes)
        barrier = context.Barrier(clients)
        results = context.Queue()
        processes = [
            context.Process(
                target=_client_process, args=(url, index, chunk_bytes, chunks, repeats, barrier, results)
            )
            for index in range(clients)
        ]
        for process in processes:
            process.start()
        gathered = [results.get(timeout=600) for _ in processes]
        for process in processes:
            process.join(60)
            if process.exitcode != 0:
                raise SystemExit(f"a client process exited with {process.exitcode}")
        gathered.sort(key=lambda item: item[0])
        nbytes = chunks * chunk_bytes
        rows.append(
            ClientsRow(
                clients,
                chunk_bytes,
                chunks,
                _aggregate_gbps([spans["memcpy"] for _, _, spans in gathered], nbytes),
                _aggregate_gbps([spans["store"] for _, _, spans in gathered], nbytes),
                nbytes / gathered[0][1] / 1e9,
            )
        )
    return rows


def l2_adapter_json(kind: str, root: str, capacity_gb: float, *, direct: bool = False) -> str:
    """``--l2-adapter`` JSON of a file L2 in ``root``: ``nixl`` (nixl_store_dynamic on NIXL's
    POSIX backend, ``use_direct_io`` with ``direct``) or ``fs`` (``use_odirect``)."""
    if kind == "nixl":
        params = {
            "file_path": root,
            "use_direct_io": "true" if direct else "false",
            "max_capacity_gb": str(capacity_gb),
        }
        return json.dumps({"type": "nixl_store_dynamic", "backend": "POSIX", "backend_params": params})
    if kind == "fs":
        return json.dumps({"type": "fs", "path": root, "max_capacity_gb": capacity_gb, "use_odirect": direct})
    raise SystemExit(f"the L2 must be nixl or fs, got {kind!r}")


@dataclass
class StoreFigures:
    """What bench_server.py adds to its report from this module."""

    write_back: WriteBackFigures | None = None
    clients: list[ClientsRow] = field(default_factory=list)

    def to_dict(self, l2: str | None, direct: bool) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.write_back is not None:
            data["write_back_store"] = {**self.write_back.to_dict(), "l2": l2, "direct": direct}
        if self.clients:
            data["clients_store"] = [row.to_dict() for row in self.clients]
        return data

    def lines(self, l2: str | None, direct: bool) -> list[str]:
        lines = []
        wb = self.write_back
        if wb is not None:
            label = f"{l2}{', O_DIRECT' if direct else ''}"
            lines += [
                f"STORE with L2 ({label}) configured, nothing written back: "
                f"{wb.l1_only_store_gbps / wb.memcpy_gbps:.2f} x memcpy ({wb.memcpy_gbps:.1f} GB/s this run)",
                f"STORE while L2 write-back runs: {wb.write_back_store_gbps / wb.memcpy_gbps:.2f} x memcpy "
                f"({wb.repeats} x {wb.chunks} x {wb.chunk_bytes >> 10} KiB back to back; L2 had it all "
                f"{wb.drained_s * 1e3:.0f} ms after the last store, {wb.write_back_gbps:.2f} GB/s)",
            ]
        for row in self.clients:
            lines.append(
                f"STORE, {row.clients} client processes at once, {row.chunk_bytes >> 10} KiB chunks: "
                f"{row.store_gbps:.2f} GB/s = {row.ratio:.2f} x the same processes' concurrent memcpy "
                f"({row.memcpy_gbps:.2f} GB/s; one process alone {row.single_memcpy_gbps:.2f} GB/s)"
            )
        return lines
