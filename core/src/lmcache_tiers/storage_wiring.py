"""The parts of a StorageManager, built in dependency order, started and stopped.

Policies are built first, so a bad name fails before gigabytes of L1 are mapped; then L1,
the adapters (each refused at once if it needs L1 memory an NVMe L1 does not have), the
engine's counters and the controllers.  Whatever was built is closed again if a later
part fails.  Stopping runs the other way: prefetches and stores drain side by side,
eviction stops after them, then the adapters close and L1 goes.  Each step of the stop
runs whatever an earlier one raised (:class:`StorageCloseFailed` names what failed).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lmcache_tiers.close_steps import logged_close_failure
from lmcache_tiers.config import AdapterSpec, ServerConfig
from lmcache_tiers.controllers import (
    AdapterSlot,
    ControllerThread,
    EngineStats,
    L1EvictionController,
    L2EvictionController,
    PrefetchController,
    StoreController,
)
from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l2.adapter import BackendCloseFailed
from lmcache_tiers.l2.build import build_adapter
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.interface import L2Adapter
from lmcache_tiers.policies import EvictionPolicy, PrefetchPolicy, StorePolicy
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.serde import build_serde_chain
from lmcache_tiers.start_failures import create_component

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def build_policy(registry: ComponentRegistry, kind: Kind, name: str) -> Any:
    """Create a policy with its config Struct's defaults (the flags carry only its name)."""
    component = registry.get(kind, name)
    try:
        config = component.config()
    except TypeError as exc:
        raise ConfigError(
            f"{component.qualified_name} needs configuration it cannot get from a flag: {exc}"
        ) from exc
    except Exception as exc:
        # A config Struct that cannot even build its defaults is the plugin's bug.
        raise ConfigError(
            f"{component.origin} cannot build its default configuration: {type(exc).__name__}: {exc}"
        ) from exc
    return create_component(component, config)


def _refuse_with_nvme_l1(name: str, built: object) -> None:
    """An NVMe L1 has no memory an adapter could address, only copies of its objects.

    ``built`` is the factory when it is a class (a backend's or an adapter's), else the
    adapter it built.
    """
    if getattr(built, "needs_l1_buffers", False):
        raise ConfigError(
            f"l2 adapter {name} needs byte access to L1 memory and cannot be used with --gds-l1-path"
        )


class StorageParts:
    """L1, the adapters (``slots``, in cascade order), the counters and the controllers."""

    def __init__(self, config: ServerConfig, registry: ComponentRegistry) -> None:
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
        self.policy_names = {
            "store_policy": config.l2_store_policy,
            "prefetch_policy": config.l2_prefetch_policy,
            "eviction_policy": config.eviction_policy,
        }
        self.l1 = L1Manager(
            config.l1_size_bytes,
            align=config.l1_align_bytes,
            lock_ttl_s=config.l1_lock_ttl_s,
            write_ttl_s=config.l1_write_ttl_s,
            shm_name=config.l1_shm_name,
            shm_dir=config.l1_shm_dir,
            nvme_path=config.gds_l1_path,
            direct_io=config.gds_l1_use_direct_io,
        )
        self.adapters: list[L2Adapter] = []
        try:
            self.slots = [
                self._build_adapter(registry, index, spec) for index, spec in enumerate(config.l2_adapters)
            ]
            self.stats = EngineStats(len(self.slots))
            self.l1_eviction = L1EvictionController(
                self.l1,
                eviction_policy,
                trigger_watermark=config.eviction_trigger_watermark,
                eviction_ratio=config.eviction_ratio,
                stats=self.stats,
            )
            self.store = StoreController(self.l1, self.slots, store_policy, self.stats)
            self.prefetch = PrefetchController(
                self.l1,
                self.slots,
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
            for slot, spec in zip(self.slots, config.l2_adapters, strict=True):
                if spec.config.eviction is not None:
                    policy = build_policy(
                        registry, Kind.EVICTION_POLICY, spec.config.eviction.eviction_policy
                    )
                    self.l2_evictions[slot.index] = L2EvictionController(
                        slot, policy, spec.config.eviction, self.stats
                    )
        except BaseException:
            self._discard_controllers()
            self._close_adapters()
            self.l1.close()
            raise

    def _discard_controllers(self) -> None:
        """Controllers built by a start-up that fails later: never started, they still hold
        their wake-up descriptors (a process that retries start-up would collect them)."""
        built: list[ControllerThread | None] = [
            getattr(self, name, None) for name in ("l1_eviction", "store", "prefetch")
        ]
        built += getattr(self, "l2_evictions", {}).values()
        for controller in built:
            if controller is None:
                continue
            try:
                controller.stop(0.0)
            except Exception:
                logger.exception("discarding controller %s failed", controller.name)

    def _build_adapter(self, registry: ComponentRegistry, index: int, spec: AdapterSpec) -> AdapterSlot:
        name = f"{index}:{spec.type}"
        context = AdapterContext(
            index=index,
            name=name,
            config=spec.config,
            serde=build_serde_chain(spec.serde, registry, name, f"$.l2_adapters[{index}]"),
            l1_buffer=self.l1.arena.buffer if self.l1.is_memory else None,
            l1_is_memory=self.l1.is_memory,
            l1_capacity=self.l1.capacity_bytes,
        )
        adapter = build_adapter(registry, spec, context)
        if not self.l1.is_memory:
            # A factory function hides the class until the adapter exists.
            try:
                _refuse_with_nvme_l1(context.name, adapter)
            except ConfigError:
                # The refusal is the error raised: a close failing on top is only logged.
                _close_logging_failure(adapter)
                raise
        self.adapters.append(adapter)
        return AdapterSlot(index, spec.type, adapter)

    def controllers(self) -> list[ControllerThread]:
        return [self.l1_eviction, self.store, self.prefetch, *self.l2_evictions.values()]

    def start(self) -> None:
        for controller in self.controllers():
            controller.start()

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until every controller has processed what it was handed; False on timeout."""
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

    def close(self, drain_timeout_s: float) -> None:
        """Finish in-flight L2 work (up to ``drain_timeout_s``), stop every thread, close
        the adapters and release L1.  Call once.

        Every step runs whatever an earlier one raised: a controller whose stop or join
        fails must not keep the adapters' connections, files and locks, the other threads
        or L1 past the close, nor leave the store's unstored writes uncounted.  Each
        failure is logged with its traceback; :class:`StorageCloseFailed` then names them
        all."""
        steps = _CloseSteps()
        # Stores and prefetches drain side by side; eviction stops after them so a
        # prefetch that needs room can still get it.
        draining: list[ControllerThread] = [self.prefetch, self.store]
        for controller in draining:
            steps.run(
                f"asking {controller.name} to stop",
                functools.partial(controller.request_stop, drain_timeout_s),
            )
        for controller in draining:
            self._join(controller, steps)
        evictors: list[ControllerThread] = [*self.l2_evictions.values(), self.l1_eviction]
        for evictor in evictors:
            steps.run(f"asking {evictor.name} to stop", functools.partial(evictor.request_stop, 0.0))
        for evictor in evictors:
            self._join(evictor, steps)
        for adapter in self.adapters:
            steps.run(f"closing L2 adapter {adapter.name}", functools.partial(self._close_adapter, adapter))
        steps.run("releasing L1", self.l1.close)
        steps.raise_failures()

    def _close_adapter(self, adapter: L2Adapter) -> None:
        try:
            adapter.close()
        except BackendCloseFailed:
            # Its backend left its close undone (a last checkpoint), by raising or by not
            # returning in time (BackendCloseTimedOut): counted among the failures too, as
            # a metrics scrape or the stop's summary reads them.
            self.stats.fail("l2_backend_close_failed")
            raise

    def _join(self, controller: ControllerThread, steps: _CloseSteps) -> None:
        """Wait for a controller asked to stop (up to its drain deadline and grace); the
        store's unstored writes are counted now if it did not end, whatever the reason."""
        if controller.stopping:
            ended = steps.run(f"joining {controller.name}", controller.join) is True
        else:
            # Its stop request raised before taking effect: a join would wait with no
            # deadline.  The close goes on without the thread (its failure is logged).
            logger.error("%s was never asked to stop: the close goes on without it", controller.name)
            ended = False
        if not ended and controller is self.store:
            # Its step may never return: what it leaves unstored is counted now, not
            # dropped uncounted with L1 below.
            steps.run("counting the writes the store controller left", self.store.count_left_behind)

    def _close_adapters(self) -> None:
        for adapter in self.adapters:
            _close_logging_failure(adapter)


def _close_logging_failure(adapter: L2Adapter) -> None:
    """Close ``adapter`` on a start-up that failed: the start's own error is the one
    raised, so what the close raises is logged (and counted by the adapter) instead."""
    try:
        adapter.close()
    except Exception as exc:
        # One line: the adapter's error says what failed (a file it could not remove); the
        # traceback is for a developer, at debug.
        logger.error("closing L2 adapter %s failed: %s: %s", adapter.name, type(exc).__name__, exc)
        logger.debug("closing L2 adapter %s failed", adapter.name, exc_info=True)


class StorageCloseFailed(TiersError):
    """Steps of a storage close raised (each logged with its traceback when it did); the
    other steps ran all the same.  ``failures`` says what failed, one entry per step."""

    def __init__(self, failures: list[str]) -> None:
        super().__init__("; ".join(failures))
        self.failures = failures


class _CloseSteps:
    """Runs the steps of a close one after another whatever an earlier one raised, and
    remembers what failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, what: str, step: Callable[[], _T]) -> _T | None:
        """``step()``'s result; None if it raised (logged once with its traceback)."""
        try:
            return step()
        except Exception as exc:
            going_on = "the close goes on with its other steps"
            self.failed.append(logged_close_failure(logger, what, exc, going_on))
            return None

    def raise_failures(self) -> None:
        if self.failed:
            raise StorageCloseFailed(self.failed)
