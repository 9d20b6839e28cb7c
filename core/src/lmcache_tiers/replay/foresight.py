"""Eviction with foresight: what knowing the future is worth, through the server's own rules.

Belady's bound says how many hits a C-block cache could get; it does not say whether the
server's eviction mechanics (on-demand eviction of whole STOREs, tail-first batches, reads
announced after the fact) let a policy get them, nor how far ahead a policy would have to
see.  ``NextUseOracle`` answers both: it is an ``EvictionPolicy`` driven by the simulator
exactly like the installed ones, except that it is told each block's next use.

With an unlimited horizon it evicts the block needed furthest in the future first (blocks
never needed again before all others, least recently used first).  With a horizon of H
requests it only knows next uses that fall within the next H requests: blocks with no use
that close go first, in exact-LRU order, then the others, needed-last first (a use by the
request being replayed counts as one within the horizon for H >= 1).  A horizon of 0 knows
nothing and is exact LRU, hit for hit; the curve between 0 and unlimited shows how
much foresight a policy needs to close a given share of the LRU -> Belady gap.  An online
policy has a horizon of 0 and only the past to guess from.

The simulator tells the oracle which request is being replayed through ``start_request``
(the optional clock hook ``simulate_policy`` calls on every policy that has one).
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.replay.lending_heap import LendingHeap
from lmcache_tiers.replay.trace import KeySpace, Trace

NEXT_USE = "next use"
#: ``--foresight`` spelling of an unlimited horizon
UNLIMITED = ("all", "inf", "unlimited")
_NEVER = 1 << 62


def oracle_name(horizon: int | None) -> str:
    return NEXT_USE if horizon is None else f"{NEXT_USE} <= {horizon}"


def parse_horizons(specs: Sequence[str]) -> list[int | None]:
    """``--foresight`` values: request counts, or ``all`` for an unlimited horizon."""
    horizons: list[int | None] = []
    for spec in specs:
        text = spec.strip().lower()
        if text in UNLIMITED:
            horizons.append(None)
            continue
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"a foresight horizon is a number of requests or 'all', not {spec!r}") from None
        if value < 0:
            raise ValueError(f"a foresight horizon must not be negative, got {value}")
        horizons.append(value)
    return horizons


def block_uses(trace: Trace) -> dict[int, list[int]]:
    """For each block id, the indices of the requests that reference it, in order."""
    uses: dict[int, list[int]] = {}
    for index, request in enumerate(trace.requests):
        for block in request.hash_ids:
            uses.setdefault(block, []).append(index)
    return uses


class NextUseOracle:
    """Knows when each block is next referenced, up to ``horizon`` requests ahead."""

    def __init__(self, uses: dict[int, list[int]], horizon: int | None) -> None:
        if horizon is not None and horizon < 0:
            raise ValueError("horizon must not be negative")
        self._uses = uses
        self._horizon = horizon
        self._now = 0
        self._seq = itertools.count()
        # live key -> (next use, depth in its last batch, sequence number of that touch)
        self._state: dict[ObjectKey, tuple[int, int, int]] = {}
        # keys whose next use is beyond the horizon, least recently touched first
        self._unknown: OrderedDict[ObjectKey, None] = OrderedDict()
        # keys whose next use is known: (-next use, -depth, seq, key), stale entries skipped
        self._known: LendingHeap[tuple[int, int, int, ObjectKey]] = LendingHeap(self._is_current)
        # request index -> keys whose next use enters the horizon then, with that next use
        self._due: dict[int, list[tuple[ObjectKey, int]]] = {}
        self._last_started = -1

    def _is_current(self, entry: tuple[int, int, int, ObjectKey]) -> bool:
        state = self._state.get(entry[3])
        return state is not None and state[2] == entry[2] and entry[3] not in self._unknown

    def start_request(self, index: int) -> None:
        """The simulator is about to replay request ``index``: the horizon moves with it."""
        self._known.take_back()
        self._now = index
        if self._horizon is None:
            return
        for moment in range(self._last_started + 1, index + 1):
            for key, upcoming in self._due.pop(moment, ()):
                state = self._state.get(key)
                if state is not None and state[0] == upcoming and key in self._unknown:
                    del self._unknown[key]
                    self._known.push((-upcoming, -state[1], state[2], key))
        self._last_started = max(self._last_started, index)

    def _next_use(self, key: ObjectKey) -> int:
        references = self._uses.get(KeySpace.block_of(key))
        if not references:
            return _NEVER
        position = bisect.bisect_right(references, self._now)
        return references[position] if position < len(references) else _NEVER

    def _touch(self, keys: Sequence[ObjectKey], known_only: bool) -> None:
        # Back to front, as exact LRU touches a batch: the tail ends up older than the head.
        self._known.take_back()
        now, horizon = self._now, self._horizon
        for depth in range(len(keys) - 1, -1, -1):
            key = keys[depth]
            if known_only and key not in self._state:
                continue
            upcoming = self._next_use(key)
            seq = next(self._seq)
            self._state[key] = (upcoming, depth, seq)
            self._unknown.pop(key, None)
            if upcoming == _NEVER or (horizon is not None and upcoming > now + horizon):
                self._unknown[key] = None
                if upcoming != _NEVER and horizon:  # a horizon of 0 never learns a use
                    self._due.setdefault(upcoming - horizon, []).append((key, upcoming))
            else:
                self._known.push((-upcoming, -depth, seq, key))
        if len(self._known) > 4 * len(self._state) + 1024:
            self._known.rebuild(
                (-upcoming, -depth, seq, key)
                for key, (upcoming, depth, seq) in self._state.items()
                if key not in self._unknown
            )

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self._touch(keys, known_only=False)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        self._touch(keys, known_only=True)

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            if self._state.pop(key, None) is not None:
                self._unknown.pop(key, None)
        self._known.take_back()

    def victims(self) -> Iterator[ObjectKey]:
        self._known.take_back()
        yield from self._unknown
        for entry in self._known.offer():
            yield entry[3]

    def __len__(self) -> int:
        return len(self._state)


def foresight_factories(
    trace: Trace, horizons: Sequence[int | None]
) -> dict[str, Callable[[], NextUseOracle]]:
    """One oracle factory per horizon, named ``next use <= H`` (``next use`` if unlimited)."""
    uses = block_uses(trace)
    factories: dict[str, Callable[[], NextUseOracle]] = {}
    for horizon in horizons:

        def make(horizon: int | None = horizon) -> NextUseOracle:
            return NextUseOracle(uses, horizon)

        factories[oracle_name(horizon)] = make
    return factories
