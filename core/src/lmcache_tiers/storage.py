"""StorageManager: L1, the L2 adapters, the policies and the controllers, wired together.

Front ends talk only to this class.  Writes are reserved in L1, filled by the client and
committed, which queues them for L2; lookups run as prefetches that leave the hit prefix
read-locked in L1 for the reader, who releases it when done.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmcache_tiers.config import AdapterSpec, ServerConfig
from lmcache_tiers.controllers import (
    AdapterSlot,
    ControllerThread,
    EngineStats,
    L1EvictionController,
    L2EvictionController,
    PrefetchController,
    StoreController,
    aligned_total,
)
from lmcache_tiers.errors import ConfigError, L1OutOfMemoryError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Loan, L1Manager, L1Object
from lmcache_tiers.l2.build import build_adapter
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.interface import L2Adapter
from lmcache_tiers.layout import check_layout
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.policies import EvictionPolicy, PrefetchPolicy, StorePolicy
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.serde import build_serde_chain

logger = logging.getLogger(__name__)


def build_policy(registry: ComponentRegistry, kind: Kind, name: str) -> Any:
    """Create a policy with its config Struct's defaults (the flags carry only its name)."""
    component = registry.get(kind, name)
    try:
        config = component.config()
    except TypeError as exc:
        raise ConfigError(
            f"{component.qualified_name} needs configuration it cannot get from a flag: {exc}"
        ) from exc
    return component.create(config)


def _refuse_with_nvme_l1(name: str, built: object) -> None:
    """An NVMe L1 has no memory an adapter could address, only copies of its objects.

    ``built`` is the factory when it is a class (a backend's or an adapter's), else the
    adapter it built.
    """
    if getattr(built, "needs_l1_buffers", False):
        raise ConfigError(
            f"l2 adapter {name} needs byte access to L1 memory and cannot be used with --gds-l1-path"
        )


class StorageManager:
    """The two-level store behind every front end; thread-safe."""

    def __init__(self, config: ServerConfig, registry: ComponentRegistry | None = None) -> None:
        registry = registry if registry is not None else load_registry()
        self.config = config
        # Policies first: a bad name fails before gigabytes of L1 are mapped.
        store_policy: StorePolicy = build_policy(registry, Kind.STORE_POLICY, config.l2_store_policy)
        prefetch_policy: PrefetchPolicy = build_policy(
            registry, Kind.PREFETCH_POLICY, config.l2_prefetch_policy
        )
        eviction_policy: EvictionPolicy = build_policy(registry, Kind.EVICTION_POLICY, config.eviction_policy)
        if config.gds_l1_path is not None:
            # Refused before the L1 file takes its disk space; an adapter built by a factory
            # function shows its class only once it exists (checked in _build_adapter).
            for index, spec in enumerate(config.l2_adapters):
                factory = registry.get(Kind.L2_ADAPTER, spec.type).load()
                if isinstance(factory, type):
                    _refuse_with_nvme_l1(f"{index}:{spec.type}", factory)
        self.l1 = L1Manager(
            config.l1_size_bytes,
            align=config.l1_align_bytes,
            lock_ttl_s=config.l1_lock_ttl_s,
            write_ttl_s=config.l1_write_ttl_s,
            shm_name=config.l1_shm_name,
            nvme_path=config.gds_l1_path,
            direct_io=config.gds_l1_use_direct_io,
        )
        self.adapters: list[L2Adapter] = []
        self._closed = False
        self._close_lock = threading.Lock()
        try:
            self._slots = [
                self._build_adapter(registry, index, spec) for index, spec in enumerate(config.l2_adapters)
            ]
            self.stats = EngineStats(len(self._slots))
            self.l1_eviction = L1EvictionController(
                self.l1,
                eviction_policy,
                trigger_watermark=config.eviction_trigger_watermark,
                eviction_ratio=config.eviction_ratio,
                stats=self.stats,
            )
            self.store = StoreController(self.l1, self._slots, store_policy, self.stats)
            self.prefetch = PrefetchController(
                self.l1,
                self._slots,
                prefetch_policy,
                self.stats,
                max_in_flight=config.l2_prefetch_max_in_flight,
                # Room to load into is never made by dropping a write not yet in L2.
                evict=functools.partial(self.l1_eviction.evict_now, spare_unstored=True),
                align=config.l1_align_bytes,
                # Shorter than the lock TTL: the locks an expired result gives back are
                # still its own.
                result_ttl_s=config.l1_lock_ttl_s / 2,
            )
            self.l2_evictions: dict[int, L2EvictionController] = {}
            for slot, spec in zip(self._slots, config.l2_adapters, strict=True):
                if spec.config.eviction is not None:
                    policy = build_policy(
                        registry, Kind.EVICTION_POLICY, spec.config.eviction.eviction_policy
                    )
                    self.l2_evictions[slot.index] = L2EvictionController(
                        slot, policy, spec.config.eviction, self.stats
                    )
        except BaseException:
            self._close_adapters()
            self.l1.close()
            raise
        self._names = {
            "store_policy": config.l2_store_policy,
            "prefetch_policy": config.l2_prefetch_policy,
            "eviction_policy": config.eviction_policy,
        }
        for controller in self._controllers():
            controller.start()

    def _build_adapter(self, registry: ComponentRegistry, index: int, spec: AdapterSpec) -> AdapterSlot:
        context = AdapterContext(
            index=index,
            name=f"{index}:{spec.type}",
            config=spec.config,
            serde=build_serde_chain(spec.serde, registry),
            l1_buffer=self.l1.arena.buffer if self.l1.is_memory else None,
            l1_is_memory=self.l1.is_memory,
        )
        adapter = build_adapter(registry, spec, context)
        if not self.l1.is_memory:
            # A factory function hides the class until the adapter exists.
            try:
                _refuse_with_nvme_l1(context.name, adapter)
            except ConfigError:
                adapter.close()
                raise
        self.adapters.append(adapter)
        return AdapterSlot(index, spec.type, adapter)

    def _controllers(self) -> list[ControllerThread]:
        return [self.l1_eviction, self.store, self.prefetch, *self.l2_evictions.values()]

    def _check_open(self) -> None:
        if self._closed:
            raise TiersError("the storage manager is closed")

    # -- writes --------------------------------------------------------------------------

    def reserve_write(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        layouts: Sequence[str] | None = None,
    ) -> dict[ObjectKey, L1Object]:
        """Write-lock L1 extents for the keys not yet present; evicts once if L1 is full.

        ``layouts`` are the objects' tensor layouts ("" = unknown), checked against their
        sizes and handed to the L2 serde chains.  Raises L1OutOfMemoryError when even
        eviction cannot make room -- before evicting anything when even evicting every
        unlocked object would not be enough (a batch larger than L1, or L1 mostly locked).
        """
        self._check_open()
        if layouts is not None:
            if len(layouts) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")
            for layout, size in zip(layouts, sizes, strict=True):
                check_layout(layout, size)
        try:
            reserved = self.l1.reserve_write(keys, sizes, layouts=layouts)
        except L1OutOfMemoryError:
            self._refuse_if_it_cannot_fit(keys, sizes)
            self.l1_eviction.evict_now(aligned_total(sizes, self.config.l1_align_bytes))
            try:
                reserved = self.l1.reserve_write(keys, sizes, layouts=layouts)
            except L1OutOfMemoryError:
                self.stats.fail("l1_write_oom")
                raise
        if self.l1_eviction.above_watermark():
            self.l1_eviction.wake()
        return reserved

    def commit_write(self, keys: Sequence[ObjectKey], *, to_l2: bool = True) -> list[bool]:
        """Make reserved objects READY and queue them for L2 (unless ``to_l2`` is False:
        L1-only objects); False for keys not reserved.

        From their commit until their L2 stores settle, the objects are evicted only when
        nothing else can make room for a write, and counted then
        (``evicted_before_l2_store``).
        """
        self._check_open()
        with self.l1.lock:  # no eviction between the commit and the unstored flag
            done = self.l1.finish_write(keys)
            committed = [key for key, ok in zip(keys, done, strict=True) if ok]
            if to_l2:
                self.store.submit(committed)
        self.stats.add("keys_written", len(committed))
        return done

    def abort_write(self, keys: Sequence[ObjectKey]) -> None:
        self.l1.abort_write(keys)

    def _refuse_if_it_cannot_fit(self, keys: Sequence[ObjectKey], sizes: Sequence[int]) -> None:
        """Evicting for a batch that cannot fit anyway would only empty L1 for nothing."""
        new_sizes: dict[ObjectKey, int] = {}
        for key, size in zip(keys, sizes, strict=True):
            if key not in new_sizes and not self.l1.contains(key):
                new_sizes[key] = size  # a key repeated in the batch is reserved once, at its first size
        need = aligned_total(new_sizes.values(), self.config.l1_align_bytes)
        room = self.l1.reclaimable_bytes()
        if need <= room:
            return
        self.stats.fail("l1_write_cannot_fit")
        message = (
            f"a store of {len(new_sizes)} new objects needs {need} bytes of L1, but at most {room} of "
            f"{self.l1.capacity_bytes} can be made free (the rest is locked or being written): "
            "refused without evicting anything"
        )
        logger.warning("%s", message)
        raise L1OutOfMemoryError(message)

    # -- lookups and reads ---------------------------------------------------------------

    def submit_prefetch(self, keys: Sequence[ObjectKey], *, readers: int = 1) -> int:
        """Start finding the longest cached prefix of ``keys``; returns a handle.

        The prefix found (L1 hits and objects loaded from L2) is read-locked ``readers``
        times; each reader calls ``release`` for it when done.
        """
        self._check_open()
        return self.prefetch.submit(keys, readers)

    def start_prefetch(
        self, keys: Sequence[ObjectKey], *, readers: int = 1
    ) -> tuple[int, list[ObjectKey] | None]:
        """``submit_prefetch`` for a caller about to ask for the result anyway (a front end
        answering a lookup): ``(handle, locked)`` when the prefetch finished at once, which
        is the case whenever nothing is left for L2; ``locked`` is the read-locked prefix
        (its length is the hit count; release it like any prefetched prefix).  Otherwise
        ``(handle, None)``, and the result comes from ``query_prefetch``/``wait_prefetch``.
        """
        self._check_open()
        return self.prefetch.begin(keys, readers)

    def query_prefetch(self, handle: int) -> int | None:
        """Prefix hit count (L1 + L2) once done, None while running.

        The result is delivered once; later queries and unknown handles answer 0.
        """
        return self.prefetch.query(handle)

    def wait_prefetch(self, handle: int, timeout: float) -> int | None:
        """Like ``query_prefetch`` but waits up to ``timeout`` s; None if still running."""
        return self.prefetch.wait(handle, timeout)

    def discard_prefetch(self, handle: int) -> None:
        """The caller will never ask for ``handle``'s result: the read locks it holds are
        released now, or when it finishes.  A result nobody queries is given back anyway
        after half the L1 lock TTL (counted as ``prefetch_result_expired``)."""
        self.prefetch.discard(handle)

    def read(self, keys: Sequence[ObjectKey]) -> list[L1Object]:
        """Read-lock and return the READY prefix of ``keys`` (release it with ``release``)."""
        self._check_open()
        objects = self.l1.reserve_read_prefix(keys)
        self.stats.add("keys_read", len(objects))
        return objects

    def view(self, obj: L1Object) -> memoryview:
        """The bytes of a reserved or read-locked object, in the L1 arena (memory L1 only)."""
        return self.l1.view(obj)

    def lend(self, obj: L1Object, *, fill: bool = False) -> L1Loan:
        """A locked object's bytes for copying out (or, ``fill``, in), for every L1 backing:
        see :meth:`L1Manager.lend`."""
        return self.l1.lend(obj, fill=fill)

    def read_object(self, obj: L1Object, out: memoryview) -> None:
        """Copy a read-locked object's bytes into ``out``; works for every L1 backing."""
        self.l1.read_object(obj, out)

    def write_object(self, obj: L1Object, data: memoryview) -> None:
        """Fill a reserved object with exactly its size in bytes; works for every L1 backing."""
        self.l1.write_object(obj, data)

    def release(self, keys: Sequence[ObjectKey], count: int = 1) -> None:
        """Drop ``count`` read locks per key (from ``read`` or a prefetch)."""
        if not self._closed:
            self.l1.finish_read(keys, count)

    def clear(self, *, force: bool = False) -> int:
        """Delete L1 objects (unlocked ones unless ``force``); returns how many."""
        self._check_open()
        return self.l1.clear(force=force)

    def evict(self, keys: Sequence[ObjectKey]) -> int:
        """Delete ``keys`` from L1 now; L2 copies stay. Returns how many.

        Locked objects are skipped, and so are objects whose L2 store has not happened yet:
        L1 holds their only copy, and dropping an acknowledged write on request is still
        dropping it.
        """
        self._check_open()
        with self.l1.lock:
            objects = [(key, self.l1.get(key)) for key in keys]
            settled = [key for key, obj in objects if obj is not None and not obj.unstored]
            return sum(self.l1.delete(settled))

    # -- operations ----------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until committed writes are stored in L2 and evictions have caught up.

        Returns False if ``timeout`` passed first.  For tests, benchmarks and shutdown
        scripts; serving never needs it.
        """
        # Stores first: their completions are what wakes L2 eviction.
        ordered: list[ControllerThread] = [
            self.store,
            *self.l2_evictions.values(),
            self.prefetch,
            self.l1_eviction,
        ]
        deadline = None if timeout is None else time.monotonic() + timeout
        for controller in ordered:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not controller.wait_idle(left):
                return False
        return True

    def status(self) -> dict[str, Any]:
        """JSON-able snapshot: usage, counters, in-flight work and failures."""
        counters, per_adapter, failures = self.stats.snapshot()
        step_errors = sum(controller.step_errors for controller in self._controllers())
        if step_errors:
            failures["controller_step_error"] = step_errors
        l1_stats = self.l1.stats()
        adapters = []
        for slot, counts in zip(self._slots, per_adapter, strict=True):
            entry: dict[str, Any] = {"index": slot.index, "name": slot.name, "type": slot.type}
            try:
                entry["usage"] = slot.adapter.usage()
                entry["used_bytes"] = slot.adapter.used_bytes()
                entry["backend"] = slot.adapter.stats()
            except Exception as exc:  # a dead backend still gets a status line
                entry["error"] = f"{type(exc).__name__}: {exc}"
            entry.update(counts)
            eviction = self.l2_evictions.get(slot.index)
            entry["eviction"] = (
                None
                if eviction is None
                else {
                    "trigger_watermark": eviction.trigger_watermark,
                    "eviction_ratio": eviction.eviction_ratio,
                }
            )
            adapters.append(entry)
        return {
            "l1": {
                "capacity_bytes": self.l1.capacity_bytes,
                "used_bytes": l1_stats.used_bytes,
                "usage": self.l1.usage(),
                "objects": l1_stats.objects,
                "write_locked": l1_stats.write_locked,
                "read_locks": l1_stats.read_locks,
                "temporary": l1_stats.temporary,
                "fragmentation": self.l1.fragmentation(),
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
                "policy": self._names["prefetch_policy"],
                "in_flight": self.prefetch.in_flight(),
                "queued": self.prefetch.queued(),
                "max_in_flight": self.prefetch.max_in_flight,
            },
            "store": {
                "policy": self._names["store_policy"],
                "in_flight_tasks": self.store.in_flight(),
                "pending_batches": self.store.pending_batches(),
                "l1_deleted_after_store": counters.get("l1_deleted_after_store", 0),
            },
            "eviction": {
                "l1": {
                    "policy": self._names["eviction_policy"],
                    "trigger_watermark": self.l1_eviction.trigger_watermark,
                    "eviction_ratio": self.l1_eviction.eviction_ratio,
                    "evicted_keys": counters.get("l1_evicted_keys", 0),
                    "evicted_bytes": counters.get("l1_evicted_bytes", 0),
                    "runs": counters.get("l1_eviction_runs", 0),
                },
                "l2": {slot.name: per_adapter[slot.index]["keys_evicted"] for slot in self._slots},
            },
            "adapters": adapters,
            "failures": failures,
        }

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Finish in-flight L2 work (up to ``drain_timeout_s``), stop every thread, close
        the adapters and release L1.  Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        # Stores and prefetches drain side by side; eviction stops after them so a
        # prefetch that needs room can still get it.
        draining: list[ControllerThread] = [self.prefetch, self.store]
        for controller in draining:
            controller.request_stop(drain_timeout_s)
        for controller in draining:
            controller.join()
        for evictor in (*self.l2_evictions.values(), self.l1_eviction):
            evictor.stop(0.0)
        self._close_adapters()
        self.l1.close()

    def _close_adapters(self) -> None:
        for adapter in self.adapters:
            try:
                adapter.close()
            except Exception:
                logger.exception("closing L2 adapter %s failed", adapter.name)

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
