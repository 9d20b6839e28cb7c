"""The StorageManager's status: one JSON-able snapshot of usage, counters, in-flight work
and failures, for ``/status``, ``/metrics`` and ``lmcache-tiers status``.

Adapters are asked one at a time; one whose backend raises still gets its entry, with the
error instead of its usage, and the failed read is counted (``l2_status_error``) and logged
once per burst: every scrape would otherwise repeat it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Collection, Mapping
from typing import Any

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.controllers import AdapterSlot
from lmcache_tiers.storage_wiring import StorageParts

#: failure reason of an adapter whose usage or stats() could not be read for a status
STATUS_ERROR = "l2_status_error"

_status_errors = BurstLog(logging.getLogger(__name__), STATUS_ERROR)

#: most of a plugin's stats of one adapter a status carries (and so /metrics, and the
#: native STATUS reply, the same document): a plugin with a key per object or per request
#: would otherwise grow every status without bound.  The core's own stats of the adapter
#: (its counters, the circuit breaker's gauges: a bounded set) are carried besides.
MAX_STATUS_STATS = 256

#: failure reason of an adapter's stats left out of a status, past ``MAX_STATUS_STATS``
STATS_LEFT_OUT = "l2_stats_left_out"

_stats_left_out = BurstLog(logging.getLogger(__name__), STATS_LEFT_OUT)


def storage_status(parts: StorageParts) -> dict[str, Any]:
    """See :meth:`lmcache_tiers.storage.StorageManager.status`."""
    counters, per_adapter, _ = parts.stats.snapshot()
    l1_stats = parts.l1.stats()
    adapters = []
    for slot, counts in zip(parts.slots, per_adapter, strict=True):
        entry = _adapter_entry(parts, slot)
        entry.update(counts)
        eviction = parts.l2_evictions.get(slot.index)
        entry["eviction"] = (
            None
            if eviction is None
            else {
                "trigger_watermark": eviction.trigger_watermark,
                "eviction_ratio": eviction.eviction_ratio,
            }
        )
        adapters.append(entry)
    # read after the adapters, so that a status read failing now is counted in this status
    failures = failure_counts(parts)
    return {
        "l1": {
            "capacity_bytes": parts.l1.capacity_bytes,
            "used_bytes": l1_stats.used_bytes,
            "usage": parts.l1.usage(),
            "objects": l1_stats.objects,
            "write_locked": l1_stats.write_locked,
            "read_locks": l1_stats.read_locks,
            "temporary": l1_stats.temporary,
            "fragmentation": parts.l1.fragmentation(),
        },
        "requests": {
            "lookups": counters.get("lookups", 0),
            "lookup_keys": counters.get("lookup_keys", 0),
            "l1_hit_chunks": counters.get("l1_hit_chunks", 0),
            "l2_hit_chunks": counters.get("l2_hit_chunks", 0),
            "keys_written": counters.get("keys_written", 0),
            "keys_read": counters.get("keys_read", 0),
        },
        "prefetch": {
            "policy": parts.policy_names["prefetch_policy"],
            "in_flight": parts.prefetch.in_flight(),
            "queued": parts.prefetch.queued(),
            "max_in_flight": parts.prefetch.max_in_flight,
        },
        "store": {
            "policy": parts.policy_names["store_policy"],
            "in_flight_tasks": parts.store.in_flight(),
            "pending_batches": parts.store.pending_batches(),
            "l1_deleted_after_store": counters.get("l1_deleted_after_store", 0),
            # committed keys that left L1 before their store began (the cause is a failure)
            "skipped_gone": counters.get("l2_store_skipped_gone", 0),
        },
        "eviction": {
            "l1": {
                "policy": parts.policy_names["eviction_policy"],
                "trigger_watermark": parts.l1_eviction.trigger_watermark,
                "eviction_ratio": parts.l1_eviction.eviction_ratio,
                "evicted_keys": counters.get("l1_evicted_keys", 0),
                "evicted_bytes": counters.get("l1_evicted_bytes", 0),
                "runs": counters.get("l1_eviction_runs", 0),
            },
            "l2": {slot.name: per_adapter[slot.index]["keys_evicted"] for slot in parts.slots},
        },
        "adapters": adapters,
        "failures": failures,
    }


def failure_counts(parts: StorageParts) -> dict[str, int]:
    """Every failure counted so far, by reason: the engine's counters and the steps of its
    controllers that raised."""
    failures = parts.stats.failures()
    for reason, count in parts.l1.failures().items():  # e.g. the NVMe L1's write-back errors
        failures[reason] = failures.get(reason, 0) + count
    step_errors = sum(controller.step_errors for controller in parts.controllers())
    if step_errors:
        failures["controller_step_error"] = step_errors
    return failures


def _adapter_entry(parts: StorageParts, slot: AdapterSlot) -> dict[str, Any]:
    """The adapter's usage and backend stats, or the error that kept them from being read."""
    entry: dict[str, Any] = {"index": slot.index, "name": slot.name, "type": slot.type}
    try:
        entry["usage"] = slot.adapter.usage()
        entry["used_bytes"] = slot.adapter.used_bytes()
        entry["backend"] = _capped_stats(parts, slot, entry, slot.adapter.stats())
    except Exception as exc:  # a dead backend still gets a status line
        entry["error"] = f"{type(exc).__name__}: {exc}"
        parts.stats.fail(STATUS_ERROR)
        _status_errors.warn(
            slot.name, "%s: its usage or stats could not be read: %s", slot.name, entry["error"]
        )
    return entry


def _own_stat_names(slot: AdapterSlot) -> Collection[str]:
    """The stats the core keeps for the adapter (its counters, the circuit breaker's gauges);
    none for an adapter a plugin builds whole, whose stats are all its own."""
    own = getattr(slot.adapter, "own_stat_names", None)
    return own() if callable(own) else ()


class _KeptPluginStats:
    """Per adapter, the plugin's stats the last status carried.  Kept while the plugin
    still reports them (a stat in one read and out of the next would make its /metrics
    series come and go, read as a counter reset); a stat it no longer reports frees its
    place, so a plugin whose per-object names churn still has stats carried."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # statuses are read on several HTTP threads at once
        self._kept: dict[int, set[str]] = {}

    def choose(self, index: int, plugin: Collection[str]) -> set[str]:
        """At most ``MAX_STATUS_STATS`` of ``plugin``: those kept before, then new ones in
        name order while there is room."""
        with self._lock:
            kept = self._kept.get(index, set()) & set(plugin)
            room = MAX_STATUS_STATS - len(kept)
            if room > 0:
                kept.update(sorted(set(plugin) - kept)[:room])
            self._kept[index] = kept
            return set(kept)


# one per storage: two servers in one process (as in tests) keep their own
_kept_by_parts: weakref.WeakKeyDictionary[StorageParts, _KeptPluginStats] = weakref.WeakKeyDictionary()
_kept_by_parts_lock = threading.Lock()


def _kept_plugin_stats(parts: StorageParts) -> _KeptPluginStats:
    with _kept_by_parts_lock:
        return _kept_by_parts.setdefault(parts, _KeptPluginStats())


def _capped_stats(parts: StorageParts, slot: AdapterSlot, entry: dict[str, Any], stats: Any) -> Any:
    """An adapter's stats with the core's own all kept (what ``lmcache-tiers status`` and
    /metrics read, such as ``circuit_open`` and ``backend_errors``, and the drops the core
    counts) and at most ``MAX_STATUS_STATS`` of its plugin's, chosen by
    :class:`_KeptPluginStats`.  The number of the plugin's others goes into ``entry`` as
    ``backend_stats_left_out``, is counted and logged once per burst per adapter.  An
    answer that is no mapping is left as it is (the metrics count it as unreadable)."""
    if not isinstance(stats, Mapping):
        return stats
    own = _own_stat_names(slot)
    plugin = [str(stat) for stat in stats if stat not in own]
    # chosen under the cap too: those carried then stay when the plugin grows past it
    kept = _kept_plugin_stats(parts).choose(slot.index, plugin)
    left_out = len(plugin) - len(kept)
    if not left_out:
        return stats
    entry["backend_stats_left_out"] = left_out
    parts.stats.fail(STATS_LEFT_OUT, left_out)
    _stats_left_out.warn(
        slot.name,
        "%s: stats of its plugin over the cap of %d, left out of /status and /metrics (%d now, e.g. %r)",
        slot.name,
        MAX_STATUS_STATS,
        left_out,
        min(set(plugin) - kept),
        count=left_out,
    )
    return {stat: value for stat, value in stats.items() if stat in own or str(stat) in kept}
