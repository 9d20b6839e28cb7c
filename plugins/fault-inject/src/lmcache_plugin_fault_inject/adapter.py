"""The ``fault_inject`` adapter: a BatchL2Adapter whose backend is another adapter."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence

from lmcache_plugin_fault_inject import FaultInjectConfig
from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BatchL2Adapter, BlockingAdapterClient, L2Adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import build_serde_chain

log = logging.getLogger("lmcache_tiers.l2.fault_inject")


class InjectedFault(OSError):
    """The failure ``fail_mode = "raise"`` throws out of a backend call."""


def open_inner(config: FaultInjectConfig, context: AdapterContext) -> L2Adapter:
    """Build the wrapped adapter from its spec, as the StorageManager would."""
    registry = load_registry()
    try:
        spec = decode_adapter(registry, config.inner, context.index)
    except ConfigError as exc:
        raise ConfigError(f"fault_inject `inner`: {exc}") from exc
    if spec.config.eviction is not None:
        log.warning("%s: eviction of the inner adapter never runs; set it on fault_inject", context.name)
    inner_context = AdapterContext(
        index=context.index,
        name=f"{context.name}>{spec.type}",
        config=spec.config,
        serde=build_serde_chain(spec.serde, registry),
        l1_buffer=context.l1_buffer,
        l1_is_memory=context.l1_is_memory,
    )
    inner: L2Adapter = registry.get(Kind.L2_ADAPTER, spec.type).create(spec.config, inner_context)
    return inner


def gap_positions(count: int, indices: Sequence[int], tail_ratios: Sequence[float]) -> set[int]:
    """Positions of a ``count``-key load batch that the gap settings always drop."""
    if count == 0:
        return set()
    positions = {index if index >= 0 else count + index for index in indices}
    positions.update(round((1.0 - ratio) * (count - 1)) for ratio in tail_ratios)
    return {position for position in positions if 0 <= position < count}


class FaultInjectAdapter(BatchL2Adapter):
    """Runs each operation on the inner adapter, failing, delaying or corrupting some.

    Pins, accounting and the wrapper's serde chain live in this adapter's base class; the
    inner adapter's lookup pins are dropped as soon as its lookup answers, since every
    delete reaches it through this wrapper, which refuses pinned keys.
    """

    def __init__(self, config: FaultInjectConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self.fault_config = config
        self.inner = open_inner(config, context)
        self._client = BlockingAdapterClient(self.inner, timeout=None)
        # One generator per operation kind: each kind runs on its own worker thread, so
        # the sequence of decisions per kind does not depend on thread interleaving.
        self._random = {
            op: random.Random(f"{config.seed}:{op}") for op in ("store", "lookup", "load", "delete")
        }
        self._fail_rates = {
            "store": config.rate if config.store_fail_rate is None else config.store_fail_rate,
            "lookup": config.rate if config.lookup_fail_rate is None else config.lookup_fail_rate,
            "load": config.rate if config.load_fail_rate is None else config.load_fail_rate,
            "delete": config.delete_fail_rate,
        }

    # -- decisions -----------------------------------------------------------------------------

    def _before_call(self, op: str, count: int) -> list[bool]:
        """Delay if chosen, then decide which of ``count`` keys fail (True = fail)."""
        rng = self._random[op]
        config = self.fault_config
        if op in config.delay_ops and config.delay_s > 0 and rng.random() < config.delay_rate:
            self.count(f"injected_{op}_delays")
            if not self.sleep_unless_closed(config.delay_s):
                return [True] * count
        rate = self._fail_rates[op]
        if config.fail_mode == "keys":
            failed = [rng.random() < rate for _ in range(count)]
        else:
            failed = [rng.random() < rate] * count
            if failed and failed[0] and config.fail_mode == "raise":
                self.count(f"injected_{op}_failures", count)
                raise InjectedFault(f"injected {op} failure")
        self.count(f"injected_{op}_failures", sum(failed))
        return failed

    # -- plain batch I/O on the inner adapter ----------------------------------------------------

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        failed = self._before_call("store", len(keys))
        chosen = [i for i, fail in enumerate(failed) if not fail]
        ok = [False] * len(keys)
        if chosen:
            stored = self._client.store([keys[i] for i in chosen], [payloads[i] for i in chosen])
            for index, success in zip(chosen, stored, strict=True):
                ok[index] = success
        return ok

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        failed = self._before_call("lookup", len(keys))
        chosen = [i for i, fail in enumerate(failed) if not fail]
        sizes: list[int | None] = [None] * len(keys)
        if chosen:
            asked = [keys[i] for i in chosen]
            try:
                result = self._client.lookup_and_lock(asked, timeout=self.fault_config.lookup_timeout_s)
            except TimeoutError:
                self.count("inner_lookup_timeouts")
                return sizes
            self.inner.unlock([key for key, hit in zip(asked, result.found, strict=True) if hit])
            for index, hit, size in zip(chosen, result.found, result.sizes, strict=True):
                sizes[index] = size if hit else None
        return sizes

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        failed = self._before_call("load", len(keys))
        gaps = gap_positions(len(keys), self.fault_config.gap_indices, self.fault_config.gap_tail_ratios)
        self.count("injected_load_gaps", len(gaps))
        chosen = [i for i, fail in enumerate(failed) if not fail and i not in gaps]
        ok = [False] * len(keys)
        if chosen:
            loaded = self._client.load([keys[i] for i in chosen], [buffers[i] for i in chosen])
            for index, success in zip(chosen, loaded, strict=True):
                ok[index] = success and not self._maybe_corrupt(buffers[index])
        if gaps:
            log.debug("%s: dropped %d/%d load keys at %s", self.name, len(gaps), len(keys), sorted(gaps))
        return ok

    def _maybe_corrupt(self, buffer: memoryview) -> bool:
        """Flip one byte with ``corrupt_rate``; True if the load must report failure."""
        rng = self._random["load"]
        if buffer.nbytes == 0 or rng.random() >= self.fault_config.corrupt_rate:
            return False
        buffer[rng.randrange(buffer.nbytes)] ^= 0xFF
        self.count("injected_corruptions")
        return self.fault_config.corrupt_detected

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        failed = self._before_call("delete", len(keys))
        chosen = [i for i, fail in enumerate(failed) if not fail]
        ok = [False] * len(keys)
        if chosen:
            for index, success in zip(chosen, self.inner.delete([keys[i] for i in chosen]), strict=True):
                ok[index] = success
        return ok

    def iter_keys(self) -> Iterator[ObjectKey]:
        return self.inner.iter_keys()

    def capacity_bytes(self) -> int | None:
        capacity = getattr(self.inner, "capacity_bytes", None)
        return capacity() if callable(capacity) else None

    # The inner adapter's accounting is the truth about what it holds (it sees its own
    # serde's output sizes and its own recovery); the wrapper reports it unchanged.

    def usage(self) -> float:
        return self.inner.usage()

    def used_bytes(self) -> int:
        return self.inner.used_bytes()

    def used_bytes_by_salt(self) -> dict[str, int]:
        return self.inner.used_bytes_by_salt()

    def stats(self) -> dict[str, int]:
        stats = super().stats()
        stats.update({f"inner_{name}": value for name, value in self.inner.stats().items()})
        return stats

    def interrupt_backend(self) -> None:
        # Closing the inner adapter fails its pending tasks, which releases the workers
        # of this adapter that wait on them.
        self.inner.close()

    def close_backend(self) -> None:
        self.inner.close()
