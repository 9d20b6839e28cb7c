"""What the simulator replays a trace against: the server's L1, and an optional L2.

The L1 model follows ``StorageManager`` and ``L1Manager`` rule for rule, so that replaying
a trace through a real server with an L1 of C blocks gives the simulated hit rate:

* a LOOKUP read-locks the leading present blocks (``on_keys_read``), a RETRIEVE reads
  the same prefix again, and both locks are released before the request stores;
* a STORE of the missing blocks reserves those not present; when they do not fit, it is
  refused at once (nothing evicted, nothing stored) if even evicting every unlocked block
  would not make room; otherwise the eviction policy's victims are taken (present,
  unlocked ones only) until as many blocks as the STORE named are freed --
  ``reserve_write`` frees the bytes of the whole request, not just the shortfall -- then
  the reservation is retried once and refused if it still does not fit;
* committed blocks are announced in prefix order (``on_keys_written``), removals once
  per eviction, after the victims iterator is done with (``on_keys_removed``);
* optionally, background eviction at a trigger watermark (``eviction_ratio`` of the used
  bytes, in rounds until usage is below the watermark), run right after each store, where
  the server's thread runs it shortly after.

All blocks have one size, so capacity is a number of blocks.  The L2 model is coarser:
every block committed to L1 is stored (the ``default`` store policy), the adapter's own
policy makes room on demand, and blocks loaded from it become temporary L1 objects that
are freed after their read (the ``default`` prefetch policy) unless ``retain_loaded``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.policies import EvictionPolicy

Key = ObjectKey


class CacheModel:
    """Present blocks of one tier and the policy ordering them."""

    def __init__(self, policy: EvictionPolicy, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("a tier must hold at least one block")
        self.policy = policy
        self.capacity = capacity_blocks
        self.present: set[Key] = set()
        self.evicted = 0

    @property
    def free(self) -> int:
        return self.capacity - len(self.present)

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        present = self.present
        hits = 0
        for key in keys:
            if key not in present:
                break
            hits += 1
        return hits

    def read(self, keys: Sequence[Key]) -> None:
        if keys:
            self.policy.on_keys_read(keys)

    def evict(self, blocks: int, locked: Iterable[Key] = ()) -> list[Key]:
        """Take victims until ``blocks`` are freed or none is left (``L1Manager.evict``)."""
        if blocks <= 0:
            return []
        present = self.present
        skip = set(locked)
        evicted: list[Key] = []
        for key in self.policy.victims():
            if key not in present or key in skip:
                continue
            present.discard(key)
            evicted.append(key)
            if len(evicted) >= blocks:
                break
        self.evicted += len(evicted)
        self.policy.on_keys_removed(evicted)  # empty after a walk that evicted nothing, too
        return evicted

    def remove(self, keys: Sequence[Key]) -> None:
        gone = [key for key in keys if key in self.present]
        self.present.difference_update(gone)
        if gone:
            self.policy.on_keys_removed(gone)

    def add(self, keys: Sequence[Key]) -> None:
        """Make reserved keys present and announce them (``finish_write``)."""
        self.present.update(keys)
        if keys:
            self.policy.on_keys_written(keys)


class L1Model(CacheModel):
    """The server's L1: on-demand eviction in ``reserve_write``, optional watermark."""

    def __init__(
        self,
        policy: EvictionPolicy,
        capacity_blocks: int,
        *,
        trigger_watermark: float | None = None,
        eviction_ratio: float = 0.2,
        capacity_units: float | None = None,
    ) -> None:
        super().__init__(policy, capacity_blocks)
        self.trigger_watermark = trigger_watermark
        self.eviction_ratio = eviction_ratio
        # The arena in block units; slightly more than `capacity` when it has slack.
        self.capacity_units = capacity_units if capacity_units is not None else float(capacity_blocks)
        self.refused_stores = 0

    def reserve(self, keys: Sequence[Key], *, locked: Iterable[Key] = ()) -> list[Key] | None:
        """The keys of ``keys`` not present, reserved all or nothing; None if refused.

        ``StorageManager.reserve_write``: on a miss of room, evict as many blocks as the
        write reserves (its keys not present), round after round -- a round may evict keys
        of the write itself, which it then reserves anew -- until it fits, a round evicts
        nothing, or the rounds have evicted the room there was when it began.
        """
        present = self.present
        wanted = [key for key in keys if key not in present]
        if len(wanted) <= self.free:
            return wanted
        locked = list(locked)
        room = self.capacity - len({key for key in locked if key in present})
        if len(wanted) > room:
            # Even evicting every unlocked block would not make room: refused before
            # anything is evicted, as reserve_write does.
            self.refused_stores += 1
            return None
        need = len(wanted)
        evicted = 0
        while True:
            freed = len(self.evict(need, locked))
            evicted += freed
            wanted = [key for key in keys if key not in present]
            if len(wanted) <= self.free:
                return wanted
            if freed <= 0 or evicted >= room:
                self.refused_stores += 1
                return None

    def store(self, keys: Sequence[Key]) -> list[Key]:
        """STORE ``keys``: the newly present ones, in prefix order (empty if refused)."""
        if not keys:
            return []
        reserved = self.reserve(keys)
        if not reserved:
            return []
        self.add(reserved)
        self.after_write()
        return reserved

    def after_write(self) -> None:
        watermark = self.trigger_watermark
        while watermark is not None and len(self.present) / self.capacity_units >= watermark:
            # evict_now(int(used_bytes * ratio)) frees whole blocks until that much is gone,
            # round after round until below the watermark or a round frees nothing
            if not self.evict(math.ceil(len(self.present) * self.eviction_ratio)):
                break

    def reserve_prefetch(self, keys: Sequence[Key], locked: Sequence[Key]) -> list[Key]:
        """``PrefetchController._reserve``: evict once, then load fewer (halving)."""
        count = len(keys)
        evicted = False
        while count > 0:
            wanted = [key for key in keys[:count] if key not in self.present]
            if len(wanted) <= self.free:
                # Keys present already are read as L1 objects; the rest is loaded.
                return list(keys[:count])
            if not evicted:
                evicted = True
                self.evict(count, locked)
                continue
            count //= 2
        return []


class TwoTierModel:
    """L1 in front of one L2 tier, replayed one request at a time."""

    def __init__(
        self, l1: L1Model, l2: CacheModel | None, *, reads_per_hit: int = 2, retain_loaded: bool = False
    ) -> None:
        if reads_per_hit < 1:
            raise ValueError("reads_per_hit must be at least 1 (the LOOKUP)")
        self.l1 = l1
        self.l2 = l2
        self.reads_per_hit = reads_per_hit
        self.retain_loaded = retain_loaded

    def request(self, keys: Sequence[Key]) -> tuple[int, int]:
        """Replay one request; returns (L1 prefix hits, L2 prefix hits)."""
        l1, l2 = self.l1, self.l2
        l1_hits = l1.prefix_hits(keys)
        l1.read(keys[:l1_hits])  # LOOKUP
        loaded: list[Key] = []
        if l2 is not None and l1_hits < len(keys):
            rest = keys[l1_hits:]
            found = l2.prefix_hits(rest)
            if found:
                locked = keys[:l1_hits]
                planned = l1.reserve_prefetch(rest[:found], locked)
                loaded = [key for key in planned if key not in l1.present]
                # keys found READY in L1 meanwhile count as hits without a load
                l1.add(loaded)
                l2.read(loaded)
                found = len(planned)
            l2_hits = found
        else:
            l2_hits = 0
        hits = l1_hits + l2_hits
        for _ in range(self.reads_per_hit - 1):
            l1.read(keys[:hits])  # RETRIEVE
        if loaded and not self.retain_loaded:
            l1.remove(loaded)  # temporary objects go with their last read lock
        stored = l1.store(keys[hits:])
        if l2 is not None and stored:
            self._store_l2(l2, stored)
        return l1_hits, l2_hits

    @staticmethod
    def _store_l2(l2: CacheModel, keys: list[Key]) -> None:
        present = l2.present
        new = [key for key in keys if key not in present]
        if len(new) > l2.free:
            l2.evict(len(new) - l2.free)
        present.update(new[: max(0, l2.free)])
        # The adapter announces every key it stored, re-stores of present ones included.
        stored = [key for key in keys if key in present]
        if stored:
            l2.policy.on_keys_written(stored)
