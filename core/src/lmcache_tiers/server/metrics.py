"""Prometheus metrics, built at scrape time from the front ends' and the storage's counters.

A custom collector on a per-server ``CollectorRegistry`` (never the process-global one, so
two servers in one process -- as in tests -- do not collide) reads plain counters when
scraped; the request path never touches a prometheus_client object or its locks.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from lmcache_tiers import __version__
from lmcache_tiers.burst import BurstLog
from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.server.frontend_totals import FrontendStatsProvider, HeldFrontendTotals
from lmcache_tiers.storage_status import MAX_STATUS_STATS

PREFIX = "lmcache_tiers"

#: failure reason of an adapter stat that is not a number, so not exported
UNEXPORTED_STAT = "metrics_stat_not_a_number"

log = logging.getLogger(__name__)

#: why a key a STORE named was skipped: L1 has it, another writer is filling it, the
#: request named it before, or the client aborted its reservation
STORE_SKIP_REASONS = ("present", "being_written", "repeated", "aborted")
#: why a key a STORE named was refused: ``reservation_lost`` (committed after its
#: reservation expired), else the error code of the refused request, e.g. ``out_of_memory``
STORE_REFUSAL_REASONS = ("reservation_lost", "out_of_memory")

#: most ``adapter_stat`` series of a plugin's stats one adapter exports: the status the
#: scrape reads carries no more (storage_status.py chooses them, the same ones from one read
#: to the next), besides the core's own stats of the adapter, a bounded set.
MAX_EXPORTED_STATS = MAX_STATUS_STATS

#: the storage engine's counters of each adapter (``keys_evicted`` is in ``evictions``)
_ENGINE_COUNTERS = {
    "store_tasks_submitted": "Store tasks handed to each L2 adapter",
    "store_tasks_completed": "Store tasks each L2 adapter finished",
    "store_tasks_failed": (
        "Store tasks of each L2 adapter that left a key unstored (failed, refused or abandoned)"
    ),
    "keys_stored": "Keys stored into each L2 adapter",
    "keys_store_failed": "Keys each L2 adapter failed to store",
    "lookups": "Lookups asked of each L2 adapter",
    "keys_found": "Keys each L2 adapter's lookups found",
    "load_tasks_submitted": "Load tasks handed to each L2 adapter",
    "keys_loaded": "Keys loaded from each L2 adapter",
    "keys_load_failed": "Keys each L2 adapter failed to load",
}


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


class TiersCollector(Collector):
    def __init__(
        self,
        frontends: FrontendStatsProvider,
        storage_status: Callable[[], dict[str, Any]],
        *,
        failed_plugins: Mapping[str, str] | None = None,
        stale_segments_removed: int = 0,
        stale_segments_kept: int = 0,
        totals: HeldFrontendTotals | None = None,
    ) -> None:
        self.frontends = frontends
        # the sum over front ends, holding the counters of one that cannot be read now
        # (shared with /status by the server, so both hold the same values)
        self._totals = totals if totals is not None else HeldFrontendTotals(frontends)
        self.storage_status = storage_status
        # fixed at start-up: the installed plugins serve started without (import or
        # registration raised); what they failed with is in /status and the start-up warning
        self.failed_plugin_count = len(failed_plugins or {})
        # fixed at start-up too: L1 segments of killed servers removed before this one started
        self.stale_segments_removed = stale_segments_removed
        # and those it left in place (in use, or no proof they are not): memory still taken
        self.stale_segments_kept = stale_segments_kept
        self._lock = threading.Lock()  # scrapes run on several HTTP threads at once
        # failures of the scrape itself, by reason: kept here, for as long as the server
        self._own_failures: Counter[str] = Counter()
        # per adapter: the values of its plugin's stats the scraped statuses left out
        self._stats_left_out: Counter[str] = Counter()
        # the collector's own: one per module would let one server's lines hide another's
        self._unexported_stats = BurstLog(logging.getLogger(__name__), UNEXPORTED_STAT)

    def own_failures(self) -> dict[str, int]:
        """Failures of the scrapes themselves, by reason (also in ``failures_total``)."""
        with self._lock:
            return dict(self._own_failures)

    def collect(self) -> Iterator[Any]:
        per_frontend, stats = self._read_frontends()
        storage = self.storage_status()
        requests = storage.get("requests", {})
        l1 = storage.get("l1", {})

        info = InfoMetricFamily(f"{PREFIX}_build", "lmcache-tiers version")
        info.add_metric([], {"version": __version__})
        yield info
        failed_plugins = _gauge(
            "plugins_failed_to_load",
            "Installed plugins left out because importing or registering them raised (names in /status)",
        )
        failed_plugins.add_metric([], float(self.failed_plugin_count))
        yield failed_plugins
        yield from self._single(
            "l1_stale_segments_removed",
            self.stale_segments_removed,
            "L1 segments of killed servers removed when this server started (names in /status)",
        )
        yield from self._single(
            "l1_stale_segments_kept",
            self.stale_segments_kept,
            "L1 segments of creators not seen here that start-up left in place, possibly in use "
            "(names in /status, why in the log)",
        )

        by_op = _counter("requests", "Requests served, by front end and operation", ["frontend", "op"])
        for name, part in per_frontend:
            for op, count in sorted(dict(part.requests).items()):
                by_op.add_metric([name, op], count)
        yield by_op

        yield from self._single("lookups", requests.get("lookups", 0), "LOOKUP requests")
        hits = _counter(
            "lookup_hit_chunks", "Chunks found by lookups, by tier they were served from", ["tier"]
        )
        hits.add_metric(["l1"], requests.get("l1_hit_chunks", 0))
        hits.add_metric(["l2"], requests.get("l2_hit_chunks", 0))
        yield hits
        yield from self._single("lookup_keys", requests.get("lookup_keys", 0), "Keys asked about by lookups")

        yield from self._single("stores", stats.stores, "STORE requests that stored at least one chunk")
        yield from self._single("store_chunks", stats.store_chunks, "Chunks stored by clients")
        yield from self._store_key_outcomes(stats)
        yield from self._single("retrieves", stats.retrieves, "RETRIEVE requests")
        yield from self._single("retrieve_chunks", stats.retrieve_chunks, "Chunks handed to clients")
        moved = _counter("bytes", "Payload bytes moved between clients and L1", ["direction"])
        moved.add_metric(["store"], stats.store_bytes)
        moved.add_metric(["retrieve"], stats.retrieve_bytes)
        yield moved

        usage = _gauge("l1_usage_ratio", "Allocated fraction of the L1 arena")
        usage.add_metric([], float(l1.get("usage", 0.0)))
        yield usage
        for key, doc in (
            ("used_bytes", "Allocated L1 bytes"),
            ("capacity_bytes", "L1 arena size"),
            ("objects", "Objects in L1"),
            ("read_locks", "Read locks held in L1"),
            ("write_locked", "L1 objects being written"),
        ):
            gauge = _gauge(f"l1_{key}", doc)
            gauge.add_metric([], float(l1.get(key, 0)))
            yield gauge

        yield from self._leases(l1.get("leases", {}))

        yield from self._adapters(storage.get("adapters", []))

        prefetch = storage.get("prefetch", {})
        store = storage.get("store", {})
        in_flight = _gauge("in_flight", "Work in progress, by kind", ["kind"])
        # l2_prefetches counts running and queued requests (what the prefetch controller still
        # owes); the queued ones alone show requests piling up behind the in-flight limit.
        in_flight.add_metric(["l2_prefetches"], prefetch.get("in_flight", 0) + prefetch.get("queued", 0))
        in_flight.add_metric(["l2_prefetches_queued"], prefetch.get("queued", 0))
        in_flight.add_metric(["l2_stores"], store.get("in_flight_tasks", 0) + store.get("pending_batches", 0))
        in_flight.add_metric(["client_prefetches"], stats.pending_prefetches)
        in_flight.add_metric(["client_stores"], stats.reserved_stores)
        in_flight.add_metric(["pool_requests"], stats.pool_tasks)
        yield in_flight
        yield from self._single(
            "pool_backpressure",
            stats.pool_backpressure,
            "Times a front end stopped reading requests because its pool held its bound of them",
        )
        yield from self._single(
            "pool_backpressure_bytes",
            stats.pool_backpressure_bytes,
            "Of pool_backpressure_total, the times the bytes of the requests on the pool held its bound",
        )
        yield from self._single(
            "pool_backpressure_seconds",
            stats.pool_backpressure_seconds,
            "Seconds front ends spent not reading requests because their pool held its bound of them",
        )

        failures = _counter("failures", "Failures, by reason", ["reason"])
        merged: dict[str, int] = dict(storage.get("failures", {}))
        with self._lock:
            own = dict(self._own_failures)
        for reason, count in (*dict(stats.failures).items(), *own.items()):
            merged[reason] = merged.get(reason, 0) + count
        for reason, count in sorted(merged.items()):
            failures.add_metric([reason], count)
        yield failures

        eviction = storage.get("eviction", {})
        evictions = _counter("evictions", "Objects evicted, by tier (l1 or an adapter name)", ["tier"])
        evictions.add_metric(["l1"], eviction.get("l1", {}).get("evicted_keys", 0))
        for name, count in sorted(eviction.get("l2", {}).items()):
            evictions.add_metric([str(name)], count)
        yield evictions
        yield from self._storage_counters(storage)

        clients = _gauge("clients", "Clients holding locks or seen recently")
        clients.add_metric([], stats.sessions)
        yield clients
        locked = _gauge("client_locked_keys", "Keys read-locked on behalf of clients")
        locked.add_metric([], stats.locked_keys)
        yield locked

    def _read_frontends(self) -> tuple[list[tuple[str, FrontendStats]], FrontendStats]:
        """Each readable front end's stats, and the sum the families without a
        ``frontend`` label export.  A front end read before whose ``stats()`` fails now
        (the provider leaves it out) adds the counters it last reported to that sum, not
        its gauges: without them every such counter would fall for the scrape -- a reset
        to Prometheus, and its return that front end's whole count again in ``rate()``."""
        readable, total, _ = self._totals.read()
        return readable, total

    def _adapters(self, adapters: list[dict[str, Any]]) -> Iterator[Any]:
        """Per-adapter families.  An adapter whose usage or stats could not be read has
        those samples left out rather than zeroed: a zero would read as an empty adapter
        and as a counter reset (its ``rate()`` jumping when the backend answers again)."""
        unreadable = _gauge(
            "adapter_status_error",
            "1 while an L2 adapter's usage or stats cannot be read (those samples are then left out)",
            ["adapter"],
        )
        usage = _gauge(
            "adapter_usage_ratio", "Used fraction of each L2 adapter (-1: no capacity)", ["adapter"]
        )
        used = _gauge("adapter_used_bytes", "Bytes held by each L2 adapter", ["adapter"])
        engine = {
            name: _counter(f"adapter_{name}", doc, ["adapter"]) for name, doc in _ENGINE_COUNTERS.items()
        }
        circuit_open = _gauge(
            "adapter_circuit_open",
            "1 while an adapter's circuit breaker is open (its backend not called)",
            ["adapter"],
        )
        backend_errors = _counter(
            "adapter_backend_errors", "Failed backend calls of each L2 adapter", ["adapter"]
        )
        backend_stat = _gauge(
            "adapter_stat",
            (
                "Counters and gauges of each L2 adapter's stats(), as in /status (the core's own, "
                f"and at most {MAX_EXPORTED_STATS} of the plugin's)"
            ),
            ["adapter", "stat"],
        )
        left_out = _counter(
            "adapter_stats_left_out",
            f"Values of each L2 adapter's stats() left out of adapter_stat: past {MAX_EXPORTED_STATS} "
            "of the plugin's (also in failures_total as l2_stats_left_out, with those of /status reads)",
            ["adapter"],
        )
        for adapter in adapters:
            name = str(adapter.get("name", adapter.get("index", "?")))
            backend = self._backend_stats(name, adapter["backend"]) if "backend" in adapter else None
            # a stats() answer that is no mapping is as unreadable as one that raised
            readable = "error" not in adapter and ("backend" not in adapter or backend is not None)
            unreadable.add_metric([name], 0.0 if readable else 1.0)
            # usage() and used_bytes() of an adapter a plugin builds whole are its own answers
            own = self._numeric_stats(
                name, {stat: adapter[stat] for stat in ("usage", "used_bytes") if stat in adapter}, "usage"
            )
            if "usage" in own:
                usage.add_metric([name], own["usage"])
            if "used_bytes" in own:
                used.add_metric([name], own["used_bytes"])
            for counter, family in engine.items():
                family.add_metric([name], adapter.get(counter, 0))
            if backend is None:
                continue  # left out, not zeroed, as for an adapter whose stats() raised
            if "circuit_open" in backend:
                circuit_open.add_metric([name], backend["circuit_open"])
            backend_errors.add_metric([name], backend.get("backend_errors", 0))
            for stat, value in sorted(backend.items()):
                backend_stat.add_metric([name, stat], value)
            with self._lock:
                self._stats_left_out[name] += int(adapter.get("backend_stats_left_out", 0))
                left_out.add_metric([name], self._stats_left_out[name])
        yield from (
            unreadable,
            usage,
            used,
            *engine.values(),
            circuit_open,
            backend_errors,
            backend_stat,
            left_out,
        )

    def _store_key_outcomes(self, stats: FrontendStats) -> Iterator[Any]:
        """Keys STORE requests named that were not newly stored, by reason: with
        ``store_chunks_total`` they add up to every key clients sent to be stored.  The
        usual reasons are exported at 0 from the start, so a rate over them never begins
        at a gap."""
        for outcome, usual, doc in (
            ("skipped", STORE_SKIP_REASONS, "Keys stores named that L1 did not need, by reason"),
            ("refused", STORE_REFUSAL_REASONS, "Keys stores named that were refused, not stored, by reason"),
        ):
            family = _counter(f"store_keys_{outcome}", doc, ["reason"])
            counts = dict.fromkeys(usual, 0) | dict(getattr(stats, f"store_keys_{outcome}"))
            for reason, count in sorted(counts.items()):
                family.add_metric([reason], count)
            yield family

    def _backend_stats(self, adapter: str, stats: Any) -> dict[str, float] | None:
        """The numeric stats of an adapter's ``stats()`` answer.  One that is no mapping (an
        adapter a plugin builds whole answers it itself) is None, counted and logged:
        reading it as one would fail the whole scrape."""
        if isinstance(stats, Mapping):
            return self._numeric_stats(adapter, stats, "stats()")
        self._unexported(
            f"{adapter}:stats()",
            "%s: stats() answered %s, not a mapping of stats; left out of /metrics",
            adapter,
            type(stats).__name__,
        )
        return None

    def _numeric_stats(self, adapter: str, stats: Mapping[str, Any], source: str) -> dict[str, float]:
        """The adapter's stats that are finite numbers.  ``stats()`` promises ints, but one
        broken value must not turn the whole scrape into an error, nor put a NaN or an
        infinity in a counter; each is counted, and one line per ``source`` of the adapter
        names the first (stat names may be per object: a line, or a burst key, per stat
        would grow without bound)."""
        numeric: dict[str, float] = {}
        broken: list[tuple[Any, Any]] = []
        for stat, value in stats.items():
            if isinstance(value, int | float) and _finite(value):
                numeric[str(stat)] = float(value)
            else:
                broken.append((stat, value))
        if broken:
            stat, value = broken[0]
            self._unexported(
                f"{adapter}:{source}",
                "%s: stat %r is not a number (%r); left out of /metrics, with %d more of its %s",
                adapter,
                stat,
                value,
                len(broken) - 1,
                source,
                count=len(broken),
            )
        return numeric

    def _unexported(self, what: str, message: str, *args: object, count: int = 1) -> None:
        """``count`` of an adapter's stats (or its whole ``stats()`` answer) left out of the
        scrape: counted as ``metrics_stat_not_a_number`` and logged once per burst of ``what``."""
        with self._lock:
            self._own_failures[UNEXPORTED_STAT] += count
        self._unexported_stats.warn(what, message, *args, count=count)

    @staticmethod
    def _storage_counters(storage: dict[str, Any]) -> Iterator[Any]:
        """The storage's counters that /status has and no family above carries."""
        requests = storage.get("requests", {})
        store = storage.get("store", {})
        l1_eviction = storage.get("eviction", {}).get("l1", {})
        for name, value, doc in (
            ("keys_written", requests.get("keys_written", 0), "Keys written into L1 and committed"),
            ("keys_read", requests.get("keys_read", 0), "Keys read-locked out of L1 for clients"),
            ("l1_evicted_bytes", l1_eviction.get("evicted_bytes", 0), "Bytes evicted from L1"),
            ("l1_eviction_runs", l1_eviction.get("runs", 0), "L1 eviction runs that evicted something"),
            (
                "l1_deleted_after_store",
                store.get("l1_deleted_after_store", 0),
                "L1 objects the store policy deleted once they were stored in L2",
            ),
            (
                "l2_store_skipped_gone",
                store.get("skipped_gone", 0),
                "Committed keys not stored in an adapter because they left L1 first, once per adapter "
                "meant for (the cause is under failures unless another adapter had stored the key)",
            ),
        ):
            yield from TiersCollector._single(name, value, doc)

    @staticmethod
    def _leases(leases: dict[str, int]) -> Iterator[Any]:
        held = _gauge("l1_quarantined_bytes", "L1 bytes held back for readers whose lease was broken")
        held.add_metric([], float(leases.get("quarantined_bytes", 0)))
        yield held
        extents = _gauge("l1_quarantined_extents", "L1 extents held back for readers whose lease was broken")
        extents.add_metric([], float(leases.get("quarantined_extents", 0)))
        yield extents
        lapsed = _gauge(
            "l1_lapsed_objects", "L1 objects whose read locks expired (their extent is held if they leave)"
        )
        lapsed.add_metric([], float(leases.get("lapsed_objects", 0)))
        yield lapsed
        taken = _counter(
            "l1_quarantined",
            "L1 extents held back after a forced delete, an NVMe L1 disk error or a lock expiry",
            ["reason"],
        )
        taken.add_metric(["forced"], leases.get("quarantined_forced", 0))
        taken.add_metric(["dropped"], leases.get("quarantined_dropped", 0))
        taken.add_metric(["expired"], leases.get("quarantined_expired", 0))
        taken.add_metric(["fenced"], leases.get("quarantined_fenced", 0))
        yield taken
        reclaimed = _counter(
            "l1_quarantine_reclaimed",
            "Quarantined L1 extents given back: released by their readers, or at the end of their lease",
            ["how"],
        )
        reclaimed.add_metric(["released"], leases.get("reclaimed_released", 0))
        reclaimed.add_metric(["lease_end"], leases.get("reclaimed_lease_end", 0))
        reclaimed.add_metric(["writer_done"], leases.get("reclaimed_writer_done", 0))
        yield reclaimed
        fenced = _gauge(
            "l1_fenced_bytes",
            "L1 bytes of expired write reservations whose writers may still copy into them "
            "(part of l1_quarantined_bytes), held until those writers commit or abort",
        )
        fenced.add_metric([], float(leases.get("fenced_bytes", 0)))
        yield fenced
        fenced_extents = _gauge(
            "l1_fenced_extents",
            "L1 extents of expired write reservations held until their writers commit or abort",
        )
        fenced_extents.add_metric([], float(leases.get("fenced_extents", 0)))
        yield fenced_extents
        yield from TiersCollector._single(
            "l1_quarantine_reclaimed_bytes",
            leases.get("reclaimed_bytes", 0),
            "Bytes of quarantined L1 extents given back",
        )

    @staticmethod
    def _single(name: str, value: float, doc: str) -> Iterator[CounterMetricFamily]:
        family = _counter(name, doc)
        family.add_metric([], value)
        yield family


def _finite(value: float) -> bool:
    """True for a number a sample can carry (an int beyond a float's range cannot)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def build_registry(
    frontends: FrontendStatsProvider,
    storage_status: Callable[[], dict[str, Any]],
    collector: TiersCollector | None = None,
) -> CollectorRegistry:
    """A registry of ``collector`` (by default one made of ``frontends`` and
    ``storage_status``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector if collector is not None else TiersCollector(frontends, storage_status))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
