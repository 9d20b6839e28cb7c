"""A prefetch request's record and the planning that needs no lock, thread or adapter.

The prefetch controller moves a request through its phases (``prefetch.py``); the record
keeps what the request holds at each point -- L1 read locks on its hits, adapter pins on
what lookups found, L1 load reservations -- so that every exit path can give it all back.
The functions here decide which adapter each key loads from, and how far the prefix
reaches once the loads are in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Loan, L1Object
from lmcache_tiers.l2.interface import LookupResult
from lmcache_tiers.lazy_keys import LazyKeys

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefetchRequest:
    handle: int
    keys: list[ObjectKey]
    readers: int
    l1_hits: int  # leading keys read-locked ``readers`` times
    result_deadline: float  # the result is given back if not claimed by then
    #: a lower bound on the deadlines of the L1 read locks it takes (L1's lock deadline of
    #: a time read before the first): releases given it never drop a lock another holder
    #: forgot (``L1Manager.finish_read``); None: no bound
    not_before: float | None = None
    #: its owner gives the result back itself if it does not claim it in time, and counts
    #: that: the result is not expired at ``result_deadline`` (the owner would count again
    #: a result it then found gone), only the request given up if still running by then
    owner_expires: bool = False
    remaining: list[ObjectKey] = field(default_factory=list)  # keys[l1_hits:] at start
    lookups: dict[int, int] = field(default_factory=dict)  # adapter index -> task id
    found: dict[int, LookupResult] = field(default_factory=dict)  # adapter index -> result
    pinned: dict[int, list[ObjectKey]] = field(default_factory=dict)  # pins not yet dropped
    # hand-off candidates: prefix of ``remaining``; per key, the adapter index it loads
    # from, or None for a key found READY in L1 meanwhile (read-locked like a hit)
    sources: list[int | None] = field(default_factory=list)
    reserved: dict[ObjectKey, L1Object] = field(default_factory=dict)  # write-locked
    #: per key being loaded, the other adapters (cascade order) whose lookup found it at
    #: the size its L1 object was reserved with, still pinned for it: where a failed load
    #: of it is tried next (``spare_sources``)
    spares: dict[ObjectKey, list[int]] = field(default_factory=dict)
    loads: set[tuple[int, int]] = field(default_factory=set)  # (adapter index, task id)
    loaded: set[ObjectKey] = field(default_factory=set)
    layouts: dict[ObjectKey, str] = field(default_factory=dict)  # loaded keys' stored layouts

    @property
    def held_until(self) -> float:
        """The deadline of its result (``HeldResult.deadline``): never, when its owner
        gives it back itself."""
        return math.inf if self.owner_expires else self.result_deadline

    def forget_pins(self, index: int, keys: list[ObjectKey]) -> None:
        """``keys``' pins on adapter ``index`` are being dropped."""
        dropped = set(keys)
        self.pinned[index] = [key for key in self.pinned.get(index, ()) if key not in dropped]

    def load_sizes(self, sources: Sequence[int]) -> list[int]:
        """L1 bytes of each key of the planned prefix, as its source adapter reported them."""
        return [self.found[source].sizes[position] for position, source in enumerate(sources)]

    def loads_by_adapter(self) -> dict[int, list[ObjectKey]]:
        """The keys of the usable prefix to load, grouped by source adapter."""
        to_load: dict[int, list[ObjectKey]] = {}
        for key, source in zip(self.remaining, self.sources, strict=False):
            if source is not None:
                to_load.setdefault(source, []).append(key)
        return to_load

    def spare_sources(self) -> dict[ObjectKey, list[int]]:
        """Per key of the usable prefix that loads from an adapter, the other adapters whose
        lookup found it with the size its source reported: its L1 object was reserved with
        that size, so any of them can fill it whole.  One of another size (another format
        or layout) cannot, and is no spare."""
        spares: dict[ObjectKey, list[int]] = {}
        if len(self.found) < 2:
            return spares
        positions = sorted(self.found)
        for position, (key, source) in enumerate(zip(self.remaining, self.sources, strict=False)):
            if source is None:
                continue
            size = self.found[source].sizes[position]
            others = [
                index
                for index in positions
                if index != source
                and self.found[index].found[position]
                and self.found[index].sizes[position] == size
            ]
            if others:
                spares[key] = others
        return spares

    def found_in_l1(self) -> list[ObjectKey]:
        """Keys of the usable prefix found READY in L1 after the start (read-locked)."""
        return [key for key, source in zip(self.remaining, self.sources, strict=False) if source is None]

    def loaded_prefix(self) -> tuple[int, list[ObjectKey]]:
        """How far the usable prefix reaches with the loads that succeeded (up to the first
        key that failed), and the loaded keys within that reach."""
        cut = 0
        for key, source in zip(self.remaining, self.sources, strict=False):
            if source is not None and key not in self.loaded:
                break
            cut += 1
        loaded = [
            key for key, source in zip(self.remaining[:cut], self.sources, strict=False) if source is not None
        ]
        return cut, loaded


@dataclass(eq=False)
class PrefetchLoad:
    request: PrefetchRequest
    task: tuple[int, int]  # (adapter index, task id), as in ``request.loads``
    keys: list[ObjectKey]
    objects: list[L1Object]  # reserved as loads, one per key
    loans: list[L1Loan]  # what the adapter fills, one per key; committed on success

    def commit(self, results: list[bool]) -> list[bool]:
        """Make the loaded bytes the objects' own; a commit that fails is a failed load (one
        for an object that left L1 meanwhile is left to the hand-off)."""
        committed: list[bool] = []
        for key, ok, loan in zip(self.keys, results, self.loans, strict=False):
            if ok:
                try:
                    loan.commit()
                except KeyError:
                    # The reservation left L1 (its write TTL passed) while the adapter
                    # loaded it: not the load's failure.  The hand-off, which finds it gone
                    # by identity, counts it as a loaded object lost.
                    pass
                except (ValueError, OSError, RuntimeError) as exc:
                    logger.warning("copying loaded %s into L1 failed: %s", key, exc)
                    ok = False
            committed.append(ok)
        return committed


def load_plan(answer: Any, count: int) -> dict[int, list[bool]]:
    """A prefetch policy's answer as {adapter index: bitmap over the ``count`` keys};
    raises TypeError or ValueError for an answer of the wrong shape (not a mapping, an
    index that is not an int, a bitmap that is not ``count`` booleans)."""
    if not isinstance(answer, Mapping):
        raise TypeError(f"select_load_plan returned {type(answer).__name__}, not a mapping")
    plan: dict[int, list[bool]] = {}
    for index, bitmap in answer.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"select_load_plan named adapter {index!r}, not an int index")
        flags = bitmap.tolist() if isinstance(bitmap, np.ndarray) else bitmap
        if not isinstance(flags, (list, tuple)):
            raise TypeError(f"select_load_plan gave adapter {index} a {type(bitmap).__name__}, not a bitmap")
        if len(flags) != count:
            raise ValueError(f"select_load_plan gave adapter {index} {len(flags)} flags for {count} keys")
        if not all(type(flag) is bool for flag in flags):
            raise TypeError(f"select_load_plan gave adapter {index} flags that are not booleans")
        plan[index] = list(flags)
    return plan


def contiguous_sources(
    keys: list[ObjectKey], plan: dict[int, list[bool]], found: dict[int, LookupResult]
) -> list[int]:
    """Per key of the plan's contiguous prefix, the lowest planned adapter that found it."""
    candidates = sorted(index for index in plan if index in found)
    sources: list[int] = []
    for position in range(len(keys)):
        source = next(
            (
                index
                for index in candidates
                if position < len(plan[index]) and plan[index][position] and found[index].found[position]
            ),
            None,
        )
        if source is None:
            break
        sources.append(source)
    return sources


def unique_prefix(keys: Sequence[ObjectKey]) -> list[ObjectKey]:
    """``keys`` up to the first repeat: a real prefix never holds the same chunk twice,
    and a repeat would make one L1 object stand for two positions."""
    if len(set(keys)) == len(keys):
        return list(keys)  # the usual case, decided in C
    seen: set[ObjectKey] = set()
    for position, key in enumerate(keys):
        if key in seen:
            return list(keys[:position])
        seen.add(key)
    return list(keys)


def unique_length(keys: Sequence[ObjectKey], l1_hits: int) -> int:
    """``len(unique_prefix(keys))`` without building the list; ``l1_hits`` is the length of
    the L1 prefix found with ``until_repeat`` (every key of it distinct).  Keys whose chunk
    hashes differ differ: a set of those bytes costs less than one of keys that a miss has
    not hashed yet (each field of each); a LOOKUP's new keys are not even decoded for it."""
    if l1_hits == len(keys):
        return l1_hits
    if isinstance(keys, LazyKeys):
        distinct = keys.all_distinct()
    else:
        distinct = len({key.chunk_hash for key in keys}) == len(keys)
    return len(keys) if distinct else len(unique_prefix(keys))
