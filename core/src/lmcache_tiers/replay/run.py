"""What the server and in-process replays share: pacing, payloads, counters, the report."""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.replay.trace import REPLAY_MODEL, REPLAY_SALT, KeySpace, Trace, TraceRequest

logger = logging.getLogger(__name__)

_ID_BYTES = 8
#: the longest paced replay accepted: a longer schedule is a mistaken time scale (or
#: timestamps in another unit than ms), and past ~292 years time.sleep overflows
MAX_PACED_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class ReplayOptions:
    """How requests are replayed with real bytes."""

    block_bytes: int = 16 << 10
    #: seconds of replay per second of trace time; 0 replays as fast as possible
    time_scale: float = 0.0
    timeout_s: float = 60.0
    model: str = REPLAY_MODEL
    salt: str = REPLAY_SALT
    kv_rank: int = 0


@dataclass
class ReplayTotals:
    """Counters of one replaying client (they add up across clients)."""

    requests: int = 0
    blocks: int = 0
    tokens: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    retrieved_blocks: int = 0
    retrieved_bytes: int = 0  # as retrieved: blocks stored with another --block-bytes differ
    stored_blocks: int = 0
    refused_stores: int = 0  # L1 could not make room (OUT_OF_MEMORY)
    short_retrieves: int = 0  # fewer blocks retrievable than the lookup promised
    corrupt_blocks: int = 0  # retrieved bytes that are not the block's
    failed_requests: int = 0  # timeouts and server errors other than OUT_OF_MEMORY
    seconds: float = 0.0
    lookup_latencies_s: list[float] = field(default_factory=list)

    def merge(self, other: ReplayTotals) -> None:
        for name, value in vars(other).items():
            if name == "lookup_latencies_s":
                self.lookup_latencies_s.extend(value)
            elif name == "seconds":
                self.seconds = max(self.seconds, value)
            else:
                setattr(self, name, getattr(self, name) + value)

    def count_request(self, request: TraceRequest, hits: int) -> None:
        self.requests += 1
        self.blocks += len(request.hash_ids)
        self.tokens += request.input_length
        self.hit_blocks += hits
        self.hit_tokens += request.prefix_tokens(hits)


class Payloads:
    """Block bytes that name their block: its id in the first and last 8 bytes.

    A retrieved block whose bytes do not carry its own id is counted as corrupt -- a
    storage system must never hand out another object's bytes.
    """

    def __init__(self, block_bytes: int) -> None:
        if block_bytes < 2 * _ID_BYTES:
            raise ValueError(f"blocks must be at least {2 * _ID_BYTES} bytes, got {block_bytes}")
        self.block_bytes = block_bytes
        self._scratch = np.zeros((0, block_bytes), dtype=np.uint8)

    def batch(self, blocks: Sequence[int]) -> list[np.ndarray[Any, Any]]:
        """One buffer per block, valid until the next call."""
        if len(blocks) > len(self._scratch):
            self._scratch = np.zeros(
                (max(len(blocks), 2 * len(self._scratch)), self.block_bytes), dtype=np.uint8
            )
        rows = self._scratch[: len(blocks)]
        ids = np.array(blocks, dtype=">u8").view(np.uint8).reshape(len(blocks), _ID_BYTES)
        rows[:, :_ID_BYTES] = ids
        rows[:, -_ID_BYTES:] = ids
        return list(rows)

    def matches(self, block: int, data: memoryview | bytes) -> bool:
        view = memoryview(data).cast("B")
        # Any size: replay keys do not name the block size, so a replay with another
        # --block-bytes finds the blocks an earlier one stored -- their own bytes.
        if view.nbytes < 2 * _ID_BYTES:
            return False
        expected = block.to_bytes(_ID_BYTES, "big")
        return view[:_ID_BYTES] == expected and view[-_ID_BYTES:] == expected


@dataclass
class ClientState:
    """What one replaying client works with: its counters, its keys, its payloads."""

    totals: ReplayTotals
    keyspace: KeySpace
    payloads: Payloads

    @classmethod
    def for_options(cls, options: ReplayOptions) -> ClientState:
        keyspace = KeySpace(options.model, options.salt, options.kv_rank)
        return cls(ReplayTotals(), keyspace, Payloads(options.block_bytes))


def block_buffer(block_bytes: int) -> memoryview:
    """A zeroed buffer of one block; ConfigError when even that does not fit in this
    machine's memory.

    Called before a replay starts: an L1 of a few such blocks passes the size checks, yet
    the replay's first store would end in a MemoryError traceback (it allocates several
    blocks at once).
    """
    try:
        return np.zeros(block_bytes, dtype=np.uint8).data
    except MemoryError:
        raise ConfigError(
            f"--block-bytes {block_bytes}: a buffer of one block does not fit in memory; give smaller blocks"
        ) from None


def check_pacing(trace: Trace, time_scale: float) -> None:
    """ConfigError when pacing ``trace`` at ``time_scale`` would last longer than MAX_PACED_S.

    Called before a replay starts, so an absurd schedule is one clear error, not an
    OverflowError from ``time.sleep`` in the middle of the replay.
    """
    if time_scale <= 0:
        return  # as fast as possible: no schedule
    origin = trace.requests[0].timestamp_ms
    span_s = (max(request.timestamp_ms for request in trace.requests) - origin) / 1000.0
    seconds = span_s * time_scale  # inf (not an exception) when the product overflows
    if not seconds <= MAX_PACED_S:  # also catches a NaN time scale
        raise ConfigError(
            f"a time scale of {time_scale:g} spreads the trace's {span_s:g} s of arrivals over "
            f"{seconds:g} s; a paced replay must fit in {MAX_PACED_S / 86400:g} days"
        )


def paced(
    requests: Sequence[tuple[int, TraceRequest]],
    time_scale: float,
    *,
    origin_ms: float,
    start: float,
) -> Iterator[tuple[int, TraceRequest]]:
    """Yield requests at their scaled arrival times; at once when ``time_scale`` is 0.

    A request is due ``(timestamp - origin_ms) * time_scale`` ms after ``start`` (a
    ``time.monotonic()`` value); every client of one replay uses the same origin (the
    trace's first timestamp) and start, so together they keep the trace's arrivals.
    A client that falls behind sends at once, and so does a request stamped before the
    one ahead of it (requests keep the trace's order; they are never re-sorted).  With
    ``time_scale`` 0 the first request still waits for ``start``, so that clients started
    one after the other run together.
    """
    if time_scale <= 0:
        if requests:
            delay = start - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        yield from requests
        return
    began = start
    for index, request in requests:
        due = began + (request.timestamp_ms - origin_ms) / 1000.0 * time_scale
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield index, request


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank percentile: the smallest value at least ``fraction`` of the values
    are at or below (p99 of 100 values is the 99th smallest, not the largest)."""
    if not values:
        return None
    ordered = sorted(values)
    # rounded first: 0.07 * 100 is 7.000000000000001 in floating point, whose ceiling is 8
    rank = math.ceil(round(fraction * len(ordered), 9))
    return ordered[min(len(ordered), max(1, rank)) - 1]


def _adapters_total(status: dict[str, Any], field_name: str) -> int:
    return sum(int(adapter.get(field_name, 0)) for adapter in status.get("adapters", []))


def status_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the server counted between two STATUS documents (all clients' traffic)."""

    def requests(doc: dict[str, Any], name: str) -> int:
        return int(doc.get("requests", {}).get(name, 0))

    def evicted(doc: dict[str, Any]) -> int:
        return int(doc.get("eviction", {}).get("l1", {}).get("evicted_keys", 0))

    def failures(doc: dict[str, Any]) -> dict[str, int]:
        merged = dict(doc.get("failures", {}))
        merged.update(doc.get("server", {}).get("failures", {}))
        return {name: int(value) for name, value in merged.items()}

    old_failures, new_failures = failures(before), failures(after)
    return {
        "l1_hit_blocks": requests(after, "l1_hit_chunks") - requests(before, "l1_hit_chunks"),
        "l2_hit_blocks": requests(after, "l2_hit_chunks") - requests(before, "l2_hit_chunks"),
        "l1_evicted_blocks": evicted(after) - evicted(before),
        "l2_stored_blocks": _adapters_total(after, "keys_stored") - _adapters_total(before, "keys_stored"),
        "l2_loaded_blocks": _adapters_total(after, "keys_loaded") - _adapters_total(before, "keys_loaded"),
        "l2_evicted_blocks": _adapters_total(after, "keys_evicted") - _adapters_total(before, "keys_evicted"),
        "failures": {
            name: count - old_failures.get(name, 0)
            for name, count in new_failures.items()
            if count != old_failures.get(name, 0)
        },
    }


@dataclass
class ReplayReport:
    """The outcome of a replay with real bytes, as shown and as ``--json``.

    ``server`` is the ``status_delta`` of the storage's own counters, None when they could
    not be read (the server stopped answering): the figures only the server counts -- the
    L1/L2 split, L2 traffic, evictions, its failure counters -- are then unknown (None),
    never zero.  ``stopped`` says why a replay ended before its last request or without
    those counters (None: it ran to its end and has them all)."""

    mode: str  # "server" or "in-process"
    target: str
    options: ReplayOptions
    clients: int
    totals: ReplayTotals
    server: dict[str, Any] | None
    stopped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        totals, block = self.totals, self.options.block_bytes
        latencies = totals.lookup_latencies_s
        seconds = totals.seconds

        def rate(part: int, whole: int) -> float:
            return part / whole if whole else 0.0

        return {
            "mode": self.mode,
            "target": self.target,
            "clients": self.clients,
            "block_bytes": block,
            "time_scale": self.options.time_scale,
            "requests": totals.requests,
            "seconds": seconds,
            "requests_per_s": totals.requests / seconds if seconds > 0 else 0.0,
            "blocks": totals.blocks,
            "tokens": totals.tokens,
            "hit_rate": {
                "blocks": rate(totals.hit_blocks, totals.blocks),
                "tokens": rate(totals.hit_tokens, totals.tokens),
                **self._tier_rates(),
            },
            "hit_blocks": totals.hit_blocks,
            "hit_tokens": totals.hit_tokens,
            "l1_hit_blocks": self._counted("l1_hit_blocks"),
            "l2_hit_blocks": self._counted("l2_hit_blocks"),
            "bytes": {
                "l1_stored": totals.stored_blocks * block,
                "l1_retrieved": totals.retrieved_bytes,
                "l2_stored": self._counted("l2_stored_blocks", block),
                "l2_loaded": self._counted("l2_loaded_blocks", block),
            },
            "evicted_blocks": {
                "l1": self._counted("l1_evicted_blocks"),
                "l2": self._counted("l2_evicted_blocks"),
            },
            "lookup_latency_ms": {
                "p50": _ms(percentile(latencies, 0.50)),
                "p99": _ms(percentile(latencies, 0.99)),
            },
            "stored_blocks": totals.stored_blocks,
            "refused_stores": totals.refused_stores,
            "short_retrieves": totals.short_retrieves,
            "corrupt_blocks": totals.corrupt_blocks,
            "failed_requests": totals.failed_requests,
            "server_failures": None if self.server is None else self.server.get("failures", {}),
            "stopped": self.stopped,
        }

    def _counted(self, name: str, unit: int = 1) -> int | None:
        """A figure of the server's counters (times ``unit``); None when they are unknown."""
        return None if self.server is None else int(self.server.get(name, 0)) * unit

    def _tier_rates(self) -> dict[str, float | None]:
        """The hit rates per tier, from the server's chunk counters (None when unknown)."""
        totals, server = self.totals, self.server
        if server is None:
            return dict.fromkeys(("l1_blocks", "l2_blocks", "l1_tokens", "l2_tokens"))
        l1_hits, l2_hits = server.get("l1_hit_blocks", 0), server.get("l2_hit_blocks", 0)

        def rate(part: int, whole: int) -> float:
            return part / whole if whole else 0.0

        token_rate = rate(totals.hit_tokens, totals.tokens)
        return {
            "l1_blocks": rate(l1_hits, totals.blocks),
            "l2_blocks": rate(l2_hits, totals.blocks),
            # tokens split in the blocks' proportion: the server counts chunks per tier
            "l1_tokens": token_rate * rate(l1_hits, l1_hits + l2_hits),
            "l2_tokens": token_rate * rate(l2_hits, l1_hits + l2_hits),
        }


class ReplayStopped(TiersError):
    """A replay with real bytes that ended before its last request (the server stopped answering,
    Ctrl-C, SIGTERM) or, through a server, whose server's closing counters could not be read.  ``report`` is
    what was measured until then, ``report.stopped`` saying why it is partial;
    ``exit_code`` is the one the cause asks for (1 for a failure, 128 + the signal's number
    for a signal)."""

    def __init__(self, message: str, report: ReplayReport, exit_code: int) -> None:
        super().__init__(message)
        self.report = report
        self.exit_code = exit_code


def signal_of(exc: KeyboardInterrupt | SystemExit) -> tuple[str, int]:
    """The signal a replay was stopped by (``signals_unwind`` raises these) and its exit code."""
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT.name, 128 + signal.SIGINT
    code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    try:
        return signal.Signals(code - 128).name, code
    except ValueError:
        return f"exit {code}", code


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


ProgressHook = Callable[[int], None]
