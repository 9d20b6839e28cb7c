"""Policies: small, pure objects the controllers consult (interfaces in ``protocols``).

Policies never take locks or talk to L1 or an adapter; the controllers own all of that
and call a policy from one thread at a time.  Batches are in prefix order (chunk 0
first), which is what lets an eviction policy evict the tail of a prefix before its head.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.protocols import AdapterInfo, EvictionPolicy, PrefetchPolicy, StorePolicy

__all__ = [
    "AdapterInfo",
    "EvictionPolicy",
    "LowestIndexPrefetchPolicy",
    "PrefetchPolicy",
    "StorePolicy",
    "plan_from_lowest_index",
]


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
