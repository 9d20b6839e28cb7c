"""Policy interfaces: small, pure objects the controllers consult.

Policies never take locks or talk to L1 or an adapter; the controllers own all of that
and call a policy from one thread at a time.  Batches are in prefix order (chunk 0
first), which is what lets an eviction policy evict the tail of a prefix before its head.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from lmcache_tiers.keys import ObjectKey


class AdapterInfo(NamedTuple):
    """What a policy may know about one L2 adapter of the cascade."""

    # Shadows tuple.index on purpose: the field name is part of the policy contract.
    index: int  # type: ignore[assignment]  # position in the cascade (0 = first)
    type: str  # registered adapter type, e.g. "mock"
    name: str  # instance label, e.g. "0:mock"
    usage: float  # used/capacity, -1.0 when the adapter has no capacity


@runtime_checkable
class StorePolicy(Protocol):
    """Decides where freshly written L1 objects go, and whether L1 keeps them."""

    def select_store_targets(
        self, keys: Sequence[ObjectKey], adapters: Sequence[AdapterInfo]
    ) -> dict[int, list[ObjectKey]]:
        """Map adapter index -> the keys (a subset of ``keys``) to store there."""
        ...

    def select_l1_deletions(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Of ``keys`` just stored successfully in L2, those L1 should drop now."""
        ...


@runtime_checkable
class PrefetchPolicy(Protocol):
    """Decides which adapter each L2 hit is loaded from."""

    #: False: loaded objects are temporary in L1 (freed after their last read).
    retain_loaded: bool

    def select_load_plan(
        self,
        keys: Sequence[ObjectKey],
        found: Sequence[Sequence[bool]],
        adapters: Sequence[AdapterInfo],
    ) -> dict[int, list[bool]]:
        """Map adapter index -> bitmap over ``keys`` of what to load from it.

        ``found[i][k]`` tells whether adapter ``adapters[i]`` holds ``keys[k]``.  A key
        should be planned from at most one adapter that found it; the controller trims
        the plan to its contiguous prefix.
        """
        ...


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders keys for eviction; used for L1 and for each L2 adapter alike."""

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        """Keys became present; later keys of a batch must be evicted first."""
        ...

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        """Keys were read (same tail-first ordering as writes)."""
        ...

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        """Keys are gone (deleted, evicted or freed); forget them."""
        ...

    def victims(self) -> Iterator[ObjectKey]:
        """Keys in eviction order.

        The caller stops iterating once enough is freed.  It calls no other method of
        the policy while the iterator is in use (removals it causes are reported
        afterwards), so a lazy generator over internal state is fine.
        """
        ...


def plan_from_lowest_index(
    keys: Sequence[ObjectKey], found: Sequence[Sequence[bool]], adapters: Sequence[AdapterInfo]
) -> dict[int, list[bool]]:
    """Load each key from the lowest-index adapter that holds it.

    The cascade order is the operator's order of preference (fastest first), so this is
    the natural plan; shared by the built-in prefetch policies.
    """
    plan: dict[int, list[bool]] = {}
    by_index = sorted(range(len(adapters)), key=lambda position: adapters[position].index)
    for key_position in range(len(keys)):
        for position in by_index:
            if found[position][key_position]:
                bitmap = plan.setdefault(adapters[position].index, [False] * len(keys))
                bitmap[key_position] = True
                break
    return plan


class LowestIndexPrefetchPolicy:
    """Loads each key from the lowest-index adapter that holds it.

    The built-in ``default`` and ``retain`` policies are this plan; they differ only in
    ``retain_loaded``.  Third-party policies may subclass it too.
    """

    retain_loaded = False

    def select_load_plan(
        self,
        keys: Sequence[ObjectKey],
        found: Sequence[Sequence[bool]],
        adapters: Sequence[AdapterInfo],
    ) -> dict[int, list[bool]]:
        return plan_from_lowest_index(keys, found, adapters)
