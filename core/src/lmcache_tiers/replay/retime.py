"""A re-timed variant of a trace, and what an online policy could get from it at best.

The model.  Requests are grouped into prompt trees by their first block (in a prefix forest
every block belongs to one tree).  Each tree with two or more requests becomes a Poisson
process over the trace's span (measured in requests): its intensity is its request count
times a Gaussian kernel density of its request positions (reflected at both ends), with
one bandwidth for all trees -- by default the one that maximises the leave-one-out
likelihood of the positions.  A generated request copies a random request of its tree up to
the first block only that request used (its own tail), and gives the rest fresh ids, so the
variant keeps the trees, their shared prefixes and the never-reused tails, but none of the
recorded timing beyond the smoothed rates.  Trees of one request stay where they are.

The bound.  On such traffic a block ``b`` of tree ``j`` is referenced at the rate
``rate_b(t) = c_b * density_j(t)``, ``c_b`` being how many of the tree's recorded requests
contain it.  The arrivals are independent of everything before them, so whatever a policy
does -- even one told the rates -- the expected number of blocks it holds when they are
referenced is the integral over time of the rates of the blocks it holds, and at most C of
them, all referenced before, can be held:

    E[hits] <= integral of (sum of the C largest rates among blocks already referenced) dt

``rate_bound`` integrates that (numerically, on a grid of at most 4,096 steps) for one
sample; averaged over samples it bounds the expected hit rate of every online policy on the
model.  ``RateOracle`` is a policy that is told the rates and keeps the highest ones, driven
through the server's eviction rules like any other: what knowing the rates achieves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.replay.lending_heap import LendingHeap
from lmcache_tiers.replay.trace import KeySpace, Trace, TraceRequest

RATE_ORACLE = "rate oracle"
_IMAGES = (-2, -1, 0, 1, 2)  # reflections of the kernel that matter for bandwidth <= span
_MAX_CELLS = 4096
_CHUNK_ELEMENTS = 1 << 20  # kernel values computed at once (8 MiB an array)
_ID_MASK = (1 << 64) - 1  # block ids are 8 bytes (KeySpace)


def prompt_trees(trace: Trace) -> list[list[int]]:
    """Request indices grouped by the request's first block, in order of first appearance."""
    trees: dict[int, list[int]] = {}
    for index, request in enumerate(trace.requests):
        if request.hash_ids:
            trees.setdefault(request.hash_ids[0], []).append(index)
    return list(trees.values())


def _kernel(points: np.ndarray, centres: np.ndarray, bandwidth: float, span: float) -> np.ndarray:
    """Reflected Gaussian kernel on [0, span): one row per point, one column per centre."""
    total = np.zeros((len(points), len(centres)))
    for image in _IMAGES:
        for mirrored in (2 * image * span + centres, 2 * image * span - centres):
            total += np.exp(-0.5 * ((points[:, None] - mirrored[None, :]) / bandwidth) ** 2)
    result: np.ndarray = total / (bandwidth * math.sqrt(2 * math.pi))
    return result


def _kernel_sums(
    points: np.ndarray, centres: np.ndarray, bandwidth: float, span: float, *, leave_one_out: bool = False
) -> np.ndarray:
    """``_kernel(points, centres, ...).sum(axis=1)``, a band of rows at a time: the whole
    matrix of a prompt tree of n requests takes 8 n**2 bytes (tens of GB for a system
    prompt every request of a large trace shares).  ``leave_one_out`` (points are the
    centres) leaves each point's own term out."""
    sums = np.empty(len(points))
    rows = max(1, _CHUNK_ELEMENTS // max(1, len(centres)))
    for first in range(0, len(points), rows):
        band = _kernel(points[first : first + rows], centres, bandwidth, span)
        if leave_one_out:
            count = len(band)
            band[np.arange(count), np.arange(first, first + count)] = 0.0
        sums[first : first + rows] = band.sum(axis=1)
    return sums


def bandwidth_log_likelihood(trace: Trace, bandwidth: float) -> float:
    """Mean leave-one-out log density of the positions of repeated trees' requests."""
    span = float(len(trace.requests))
    total, count = 0.0, 0
    for positions in prompt_trees(trace):
        if len(positions) < 2:
            continue
        points = np.asarray(positions, dtype=float) + 0.5
        density = _kernel_sums(points, points, bandwidth, span, leave_one_out=True) / (len(points) - 1)
        total += float(np.log(np.maximum(density, 1e-300)).sum())
        count += len(points)
    return total / count if count else 0.0


def best_bandwidth(trace: Trace, candidates: Sequence[int] | None = None) -> int:
    """The candidate bandwidth (in requests) the positions are likeliest under."""
    span = len(trace.requests)
    if candidates is None:
        candidates = [1 << power for power in range(3, max(4, span.bit_length()))]
    usable = [candidate for candidate in candidates if 0 < candidate <= span] or [max(1, span)]
    scores = {candidate: bandwidth_log_likelihood(trace, float(candidate)) for candidate in usable}
    return max(usable, key=scores.__getitem__)


@dataclass(frozen=True)
class RateModel:
    """Reference rates of the repeated blocks of a trace, on a grid over its span."""

    span: float
    bandwidth: float
    cell: float  # grid step, in requests
    #: block id -> group index; blocks of a group share their rate at every moment
    group_of: dict[int, int]
    #: rates[group, cell]: references per request of one block of the group
    rates: np.ndarray

    def cell_of(self, moment: float) -> int:
        last: int = self.rates.shape[1] - 1
        return min(max(int(moment / self.cell), 0), last)


def fit_rates(trace: Trace, bandwidth: float) -> RateModel:
    span = float(len(trace.requests))
    cells = min(_MAX_CELLS, max(1, len(trace.requests)))
    cell = span / cells
    centres = (np.arange(cells) + 0.5) * cell
    signature_of: dict[int, list[tuple[int, int]]] = {}
    densities: list[np.ndarray] = []
    for positions in prompt_trees(trace):
        if len(positions) < 2:
            continue
        tree = len(densities)
        points = np.asarray(positions, dtype=float) + 0.5
        densities.append(_kernel_sums(centres, points, bandwidth, span) / len(points))
        counts: dict[int, int] = {}
        for index in positions:
            for block in trace.requests[index].hash_ids:
                counts[block] = counts.get(block, 0) + 1
        for block, count in counts.items():
            if count > 1:
                signature_of.setdefault(block, []).append((tree, count))
    groups: dict[tuple[tuple[int, int], ...], int] = {}
    group_of: dict[int, int] = {}
    for block, members in signature_of.items():
        group_of[block] = groups.setdefault(tuple(members), len(groups))
    rates = np.zeros((len(groups), cells))
    for parts, group in groups.items():
        for tree, count in parts:
            rates[group] += count * densities[tree]
    return RateModel(span, bandwidth, cell, group_of, rates)


@dataclass(frozen=True)
class Retimed:
    """One re-timed sample: the trace, each request's moment (in requests), and the model."""

    trace: Trace
    moments: tuple[float, ...]
    model: RateModel
    seed: int


def _reflect(moment: float, span: float) -> float:
    # Folded in one step, not reflected once per span: with a bandwidth far wider than the
    # trace, a moment many spans out would take that many steps (or, past float precision,
    # never leave the loop).
    period = 2.0 * span
    moment = math.fmod(moment, period)
    if moment < 0.0:
        moment += period
    if moment >= span:
        moment = period - moment
    if moment >= span:  # exactly on the far edge, which the span excludes
        moment = math.nextafter(span, 0.0)
    return moment


def _fresh_ids(trace: Trace) -> Iterator[int]:
    """Block ids the trace does not use, counting up from its largest one.

    Ids are 64-bit: past 2**64 - 1 the count wraps to 0 and skips the trace's own ids (a
    trace of 64-bit hashes may use the top of the range).
    """
    used = {block for request in trace.requests for block in request.hash_ids}
    candidate = max(used, default=-1) + 1
    while True:
        candidate &= _ID_MASK
        if candidate not in used:
            yield candidate
        candidate += 1


def retime(trace: Trace, bandwidth: float, seed: int, model: RateModel | None = None) -> Retimed:
    """A sample of the model: repeated trees re-timed as Poisson processes (see the module)."""
    if bandwidth <= 0:
        raise ValueError("the bandwidth must be positive")
    model = model or fit_rates(trace, bandwidth)
    rng = np.random.default_rng(seed)
    span = float(len(trace.requests))
    fresh = _fresh_ids(trace)
    events: list[tuple[float, int, TraceRequest]] = []
    order = itertools.count()
    for positions in prompt_trees(trace):
        if len(positions) < 2:
            index = positions[0]
            events.append((index + 0.5, next(order), trace.requests[index]))
            continue
        counts: dict[int, int] = {}
        for index in positions:
            for block in trace.requests[index].hash_ids:
                counts[block] = counts.get(block, 0) + 1
        for _ in range(int(rng.poisson(len(positions)))):
            centre = positions[int(rng.integers(len(positions)))] + 0.5
            moment = _reflect(centre + float(rng.normal(0.0, bandwidth)), span)
            template = trace.requests[positions[int(rng.integers(len(positions)))]]
            blocks = list(template.hash_ids)
            for depth, block in enumerate(blocks):
                if counts[block] == 1:  # the template's own tail: nobody else has it
                    blocks[depth:] = [next(fresh) for _ in blocks[depth:]]
                    break
            events.append(
                (
                    moment,
                    next(order),
                    TraceRequest(0.0, template.input_length, template.output_length, tuple(blocks)),
                )
            )
    events.sort(key=lambda event: (event[0], event[1]))
    # Timestamps follow the original clock at the same position, for replays with --time-scale.
    clock = [request.timestamp_ms for request in trace.requests]
    requests = tuple(
        TraceRequest(
            clock[min(int(moment), len(clock) - 1)],
            request.input_length,
            request.output_length,
            request.hash_ids,
        )
        for moment, _, request in events
    )
    retimed = Trace(f"{trace.path} (re-timed: bandwidth {bandwidth:g} requests, seed {seed})", requests)
    return Retimed(retimed, tuple(moment for moment, _, _ in events), model, seed)


def rate_bound(sample: Retimed, capacities: Sequence[int], expected_references: int) -> dict[int, float]:
    """Upper bound on the expected hit rate of any online policy on the model, per capacity.

    ``expected_references`` is the model's expected block references (the original
    trace's); the result is the bound on expected hits divided by it.
    """
    model = sample.model
    groups, cells = model.rates.shape
    first_seen: dict[int, float] = {}
    for moment, request in zip(sample.moments, sample.trace.requests, strict=True):
        for block in request.hash_ids:
            if block in model.group_of and block not in first_seen:
                first_seen[block] = moment
    # eligible[group, cell]: blocks of the group referenced before the cell ends
    seen_cells = np.zeros((groups, cells))
    for block, moment in first_seen.items():
        seen_cells[model.group_of[block], model.cell_of(moment)] += 1
    eligible = np.cumsum(seen_cells, axis=1)
    totals = dict.fromkeys(capacities, 0.0)
    for column in range(cells):
        rates = model.rates[:, column]
        order = np.argsort(-rates, kind="stable")
        sizes = eligible[order, column]
        held = np.cumsum(sizes)
        for capacity in capacities:
            whole = int(np.searchsorted(held, capacity, side="right"))
            value = float((rates[order[:whole]] * sizes[:whole]).sum())
            if whole < groups:
                room = capacity - (held[whole - 1] if whole else 0.0)
                value += float(rates[order[whole]]) * min(room, sizes[whole])
            totals[capacity] += value * model.cell
    if not expected_references:
        return dict.fromkeys(capacities, 0.0)  # a trace of empty prompts: nothing to hit
    return {capacity: total / expected_references for capacity, total in totals.items()}


class RateOracle:
    """An eviction policy told each block's reference rate: the lowest current rate goes first.

    Rates are re-read every 1/32 of the bandwidth (they hardly move in between) and all
    blocks re-ranked then; blocks of equal rate (those never referenced again: rate 0) go
    least recently touched first.
    """

    def __init__(self, sample: Retimed) -> None:
        model = sample.model
        self._model = model
        self._moments = sample.moments
        self._stride = max(1, int(model.bandwidth / 32 / model.cell))
        self._epoch = -1
        self._rates: list[float] = []
        self._seq = itertools.count()
        # key -> (rate, touch sequence, rate group or -1)
        self._state: dict[ObjectKey, tuple[float, int, int]] = {}
        self._heap: LendingHeap[tuple[float, int, ObjectKey]] = LendingHeap(self._is_current)

    def _is_current(self, entry: tuple[float, int, ObjectKey]) -> bool:
        state = self._state.get(entry[2])
        return state is not None and state[1] == entry[1] and state[0] == entry[0]

    def start_request(self, index: int) -> None:
        self._heap.take_back()
        epoch = self._model.cell_of(self._moments[index]) // self._stride
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self._rates = self._model.rates[:, epoch * self._stride].tolist()
        rates, state = self._rates, self._state
        for key, (_, seq, group) in state.items():
            state[key] = (rates[group] if group >= 0 else 0.0, seq, group)
        self._heap.rebuild((rate, seq, key) for key, (rate, seq, _) in state.items())

    def _touch(self, keys: Sequence[ObjectKey], known_only: bool) -> None:
        heap = self._heap
        heap.take_back()
        state, rates = self._state, self._rates
        group_of = self._model.group_of
        for depth in range(len(keys) - 1, -1, -1):  # back to front: a batch's tail is older
            key = keys[depth]
            known = state.get(key)
            if known is None:
                if known_only:
                    continue
                group = group_of.get(KeySpace.block_of(key), -1)
            else:
                group = known[2]
            rate = rates[group] if group >= 0 else 0.0
            seq = next(self._seq)
            state[key] = (rate, seq, group)
            heap.push((rate, seq, key))
        if len(heap) > 4 * len(state) + 1024:
            heap.rebuild((rate, seq, key) for key, (rate, seq, _) in state.items())

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self._touch(keys, known_only=False)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        self._touch(keys, known_only=True)

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            self._state.pop(key, None)
        self._heap.take_back()

    def victims(self) -> Iterator[ObjectKey]:
        for entry in self._heap.offer():
            yield entry[2]

    def __len__(self) -> int:
        return len(self._state)
