"""Hit rates of eviction policies on a trace, for one or more capacities, without a server.

Every installed eviction policy is driven through the ``EvictionPolicy`` protocol by the
same L1 model (``model.py``) the server's rules define; ``exact LRU`` is this module's own
recency order, independent of any plugin, which the ``LRU`` plugin must match.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.policies import EvictionPolicy
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.replay.belady import belady, infinite
from lmcache_tiers.replay.model import CacheModel, L1Model, TwoTierModel
from lmcache_tiers.replay.trace import KeySpace, Trace
from lmcache_tiers.storage import build_policy

EXACT_LRU = "exact LRU"
BELADY = "Belady"
INFINITE = "infinite"


class ExactLRU:
    """Least recently used first, a batch touched back to front: the reference order.

    A plain dict keeps insertion order; moving a key to the end is a delete and a
    re-insert.  Deliberately not the LRU plugin's code, so each checks the other.
    """

    def __init__(self) -> None:
        self._order: dict[Any, None] = {}

    def on_keys_written(self, keys: Sequence[Any]) -> None:
        order = self._order
        for key in reversed(keys):
            order.pop(key, None)
            order[key] = None

    def on_keys_read(self, keys: Sequence[Any]) -> None:
        order = self._order
        for key in reversed(keys):
            if order.pop(key, 0) is None:
                order[key] = None

    def on_keys_removed(self, keys: Sequence[Any]) -> None:
        for key in keys:
            self._order.pop(key, None)

    def victims(self) -> Iterator[Any]:
        return iter(self._order)


@dataclass
class TierSettings:
    """How the simulated server is set up around the policy under test."""

    reads_per_hit: int = 2  # LOOKUP and RETRIEVE each read-lock the hit prefix
    trigger_watermark: float | None = None  # None: background eviction never runs
    eviction_ratio: float = 0.2
    l2_policy: str = "LRU"
    retain_loaded: bool = False


@dataclass
class PolicyRun:
    """One policy at one capacity."""

    policy: str
    capacity_blocks: int
    l2_capacity_blocks: int | None
    hit_blocks: int
    l1_hit_blocks: int
    l2_hit_blocks: int
    hit_tokens: int
    total_blocks: int
    total_tokens: int
    refused_stores: int = 0
    l1_evictions: int = 0
    seconds: float = 0.0
    block_references: int = 0
    #: offline bounds hold blocks outside the hit prefix too (equal for prefix forests)
    notes: list[str] = field(default_factory=list)
    #: the hits are of one cache of L1 + L2 blocks (Belady at a two-tier point), not split
    #: by tier: ``l1_hit_blocks`` carries their total and ``l2_hit_blocks`` is 0
    combined_tiers: bool = False

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def miss_ratio(self) -> float:
        # No block referenced: nothing hit and nothing missed (0, like the hit rate), not
        # a cache that missed everything.
        return 1.0 - self.hit_rate if self.total_blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "l2_capacity_blocks": self.l2_capacity_blocks,
            "hit_rate": self.hit_rate,
            "miss_ratio": self.miss_ratio,
            "token_hit_rate": self.token_hit_rate,
            "hit_blocks": self.hit_blocks,
            "l1_hit_blocks": self.l1_hit_blocks,
            "l2_hit_blocks": self.l2_hit_blocks,
            "combined_tiers": self.combined_tiers,
            "hit_tokens": self.hit_tokens,
            "total_blocks": self.total_blocks,
            "total_tokens": self.total_tokens,
            "refused_stores": self.refused_stores,
            "l1_evictions": self.l1_evictions,
            "seconds": self.seconds,
            "block_references": self.block_references,
            "notes": self.notes,
        }


PolicyFactory = Callable[[], EvictionPolicy]


def policy_factories(
    registry: ComponentRegistry, names: Sequence[str] | None = None
) -> dict[str, PolicyFactory]:
    """``exact LRU`` plus the named (default: every installed) eviction policies.

    Aliases (two names, one factory) are simulated once, under the first name.
    """
    factories: dict[str, PolicyFactory] = {EXACT_LRU: ExactLRU}
    seen: set[Any] = set()
    # Plain names first, so an alias spelled with punctuation (S3-FIFO) yields to S3FIFO.
    chosen = (
        list(names)
        if names is not None
        else sorted(registry.names(Kind.EVICTION_POLICY), key=lambda name: (not name.isalnum(), name))
    )
    for name in chosen:
        component = registry.get(Kind.EVICTION_POLICY, name)  # ConfigError with suggestions
        identity = (component.factory, component.config)
        if identity in seen and names is None:
            continue
        seen.add(identity)

        def make(name: str = component.name) -> EvictionPolicy:
            built: EvictionPolicy = build_policy(registry, Kind.EVICTION_POLICY, name)
            return built

        factories[component.name] = make
    return factories


def _request_keys(trace: Trace, keyspace: KeySpace) -> list[list[ObjectKey]]:
    return [keyspace.keys(request.hash_ids) for request in trace.requests]


def simulate_policy(
    trace: Trace,
    name: str,
    factory: PolicyFactory,
    capacity_blocks: int,
    *,
    l2_capacity_blocks: int | None = None,
    settings: TierSettings | None = None,
    l2_factory: PolicyFactory | None = None,
    request_keys: list[list[ObjectKey]] | None = None,
) -> PolicyRun:
    """Replay ``trace`` against an L1 of ``capacity_blocks`` using the policy ``factory`` builds."""
    settings = settings or TierSettings()
    keys_by_request = request_keys if request_keys is not None else _request_keys(trace, KeySpace())
    l1 = L1Model(
        factory(),
        capacity_blocks,
        trigger_watermark=settings.trigger_watermark,
        eviction_ratio=settings.eviction_ratio,
    )
    l2 = None
    if l2_capacity_blocks is not None:
        l2 = CacheModel((l2_factory or ExactLRU)(), l2_capacity_blocks)
    model = TwoTierModel(l1, l2, reads_per_hit=settings.reads_per_hit, retain_loaded=settings.retain_loaded)
    # Analysis policies that know the trace (oracles) are told which request comes next.
    clock: Callable[[int], None] | None = getattr(l1.policy, "start_request", None)
    l1_hits = l2_hits = hit_tokens = 0
    started = time.perf_counter()
    for index, (request, keys) in enumerate(zip(trace.requests, keys_by_request, strict=True)):
        if clock is not None:
            clock(index)
        from_l1, from_l2 = model.request(keys)
        l1_hits += from_l1
        l2_hits += from_l2
        hit_tokens += request.prefix_tokens(from_l1 + from_l2)
    seconds = time.perf_counter() - started
    return PolicyRun(
        policy=name,
        capacity_blocks=capacity_blocks,
        l2_capacity_blocks=l2_capacity_blocks,
        hit_blocks=l1_hits + l2_hits,
        l1_hit_blocks=l1_hits,
        l2_hit_blocks=l2_hits,
        hit_tokens=hit_tokens,
        total_blocks=trace.block_references,
        total_tokens=trace.input_tokens,
        refused_stores=l1.refused_stores,
        l1_evictions=l1.evicted,
        seconds=seconds,
        block_references=trace.block_references,
    )


def _bound_run(
    trace: Trace, name: str, capacity: int, l2: int | None, hits: Sequence[int], held: int, seconds: float
) -> PolicyRun:
    hit_blocks = sum(hits)
    run = PolicyRun(
        policy=name,
        capacity_blocks=capacity,
        l2_capacity_blocks=l2,
        hit_blocks=hit_blocks,
        l1_hit_blocks=hit_blocks,
        l2_hit_blocks=0,
        hit_tokens=sum(
            request.prefix_tokens(count) for request, count in zip(trace.requests, hits, strict=True)
        ),
        total_blocks=trace.block_references,
        total_tokens=trace.input_tokens,
        seconds=seconds,
        block_references=trace.block_references,
    )
    if held != hit_blocks:
        run.notes.append(
            f"the trace is not a prefix forest: {held - hit_blocks} held blocks fall outside a hit prefix; "
            "the bound counts prefix hits of Belady's schedule"
        )
    return run


def belady_run(trace: Trace, capacity: int, l2_capacity: int | None = None) -> PolicyRun:
    """Belady at the capacity (L1 + L2 for a two-tier point: a bound on the total)."""
    started = time.perf_counter()
    result = belady(trace, capacity + (l2_capacity or 0))
    run = _bound_run(
        trace,
        BELADY,
        capacity,
        l2_capacity,
        result.hits_per_request,
        result.held_blocks,
        time.perf_counter() - started,
    )
    # No split by tier: the bound holds for one cache of both sizes, whatever L1 takes.
    run.combined_tiers = l2_capacity is not None
    return run


def infinite_run(trace: Trace) -> PolicyRun:
    started = time.perf_counter()
    result = infinite(trace)
    return _bound_run(
        trace, INFINITE, 0, None, result.hits_per_request, result.held_blocks, time.perf_counter() - started
    )


@dataclass
class CapacityPoint:
    """One capacity of the curve: every policy, Belady and the infinite cache."""

    capacity_blocks: int
    l2_capacity_blocks: int | None
    runs: list[PolicyRun]

    def run(self, policy: str) -> PolicyRun:
        for each in self.runs:
            if each.policy == policy:
                return each
        raise KeyError(policy)


#: ``progress(what runs next, runs finished)`` as each run starts, and once more when the
#: last one has ended: a bar that counted the calls was full while the last run still ran
ProgressCallback = Callable[[str, int], None]


def simulate_curve(
    trace: Trace,
    factories: dict[str, PolicyFactory],
    capacities: Sequence[int],
    *,
    l2_capacities: Sequence[int | None] | None = None,
    settings: TierSettings | None = None,
    l2_factory: PolicyFactory | None = None,
    progress: ProgressCallback | None = None,
) -> list[CapacityPoint]:
    """Every policy at every capacity, with Belady and the infinite cache alongside."""
    settings = settings or TierSettings()
    keys = _request_keys(trace, KeySpace())
    unbounded = infinite_run(trace)
    points: list[CapacityPoint] = []
    l2_list = list(l2_capacities) if l2_capacities is not None else [None] * len(capacities)
    finished = 0  # runs ended, for ``progress``
    for capacity, l2_capacity in zip(capacities, l2_list, strict=True):
        runs: list[PolicyRun] = []
        for name, factory in factories.items():
            if progress is not None:
                progress(f"{name} @ {capacity}", finished)
            runs.append(
                simulate_policy(
                    trace,
                    name,
                    factory,
                    capacity,
                    l2_capacity_blocks=l2_capacity,
                    settings=settings,
                    l2_factory=l2_factory,
                    request_keys=keys,
                )
            )
            finished += 1
        if progress is not None:
            progress(f"{BELADY} @ {capacity}", finished)
        runs.append(belady_run(trace, capacity, l2_capacity))
        finished += 1
        runs.append(unbounded)
        points.append(CapacityPoint(capacity, l2_capacity, runs))
    if progress is not None:
        progress("simulated", finished)
    return points


def default_capacities(trace: Trace) -> list[int]:
    """Powers of two from 256 blocks up to the first one holding every block of the trace."""
    unique = trace.unique_blocks()
    capacities = [256]
    while capacities[-1] < unique:
        capacities.append(capacities[-1] * 2)
    return capacities
