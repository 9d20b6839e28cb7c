"""The ``fault_inject`` backend: another backend's methods, called with faults injected.

The wrapped backend is built inside this adapter (``context.open_inner``), so there is
one task board, one pin table and one accounting; its serde chain runs after the
wrapper's own.  A wrapped backend of coroutines is wrapped in coroutines, so both run on
the adapter's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import random
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NamedTuple

from lmcache_plugin_fault_inject import FaultInjectConfig
from lmcache_tiers.plugin import (
    PROBE_KEY,
    BackendContext,
    Capacity,
    LeftCallThreads,
    ObjectKey,
    ObjectSize,
    PartialFailure,
    is_async_backend,
)

#: how often an asynchronous delay checks whether the adapter is closing
_DELAY_POLL_S = 0.05

Found = int | ObjectSize | None


class Decision(NamedTuple):
    """What one backend call gets injected, drawn when it starts."""

    #: seconds it sleeps first (0: none)
    delay: float
    #: per key: True if it fails
    failed: list[bool]
    #: per key of a load: where in the object its byte is flipped if it loads (a fraction
    #: of the object's size), None for a key left whole; empty for other operations
    corruptions: list[float | None]


class InjectedFault(OSError):
    """The failure ``fail_mode = "raise"`` throws out of a backend call."""


class InnerLookupTimeout(TimeoutError):
    """The inner adapter did not answer a lookup within ``lookup_timeout_s``.

    Raised rather than answered with misses: an answer of "absent" for keys this adapter
    accounts would make core forget them as removed behind its back (their bytes released
    from the usage, the eviction policy told they are gone) while the inner adapter still
    holds them.  A lookup that raises is a failed batch: every key a miss, none forgotten.
    """


class InnerLookupAbandoned(RuntimeError):
    """The adapter started closing before the inner adapter answered a lookup: given up,
    raised for the reason :class:`InnerLookupTimeout` is (every key a miss, none
    forgotten), but no timeout passed."""


def gap_positions(count: int, indices: Sequence[int], tail_ratios: Sequence[float]) -> set[int]:
    """Positions of a ``count``-key load batch that the gap settings always drop."""
    if count == 0:
        return set()
    positions = {index if index >= 0 else count + index for index in indices}
    positions.update(round((1.0 - ratio) * (count - 1)) for ratio in tail_ratios)
    return {position for position in positions if 0 <= position < count}


#: a key's hash is read as a fraction of this, compared with ``rate``
_HASH_SPAN = 1 << 64


def rate_chooses(seed: int, rate: float, key: ObjectKey) -> bool:
    """Whether ``rate`` fails every load of ``key``: a hash of ``seed`` and the key's
    encoded fields, read as a fraction of 2**64, is below the rate.

    A hash rather than a random draw, as in LMCache: the same key and seed get the same
    answer at every load, in every process and after restarts, so a chosen key is a
    stable hole in its prefix and about ``rate`` of all keys are chosen."""
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(b"%d:" % seed + key.to_bytes(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * _HASH_SPAN


def _optional(backend: object, name: str) -> Any:
    method = getattr(backend, name, None)
    return method if callable(method) else None


class _FaultInjector:
    """Decisions (seeded), bookkeeping and the parts both flavours share."""

    def __init__(self, config: FaultInjectConfig, context: BackendContext, inner: Any) -> None:
        self.config = config
        self.context = context
        self.inner = inner
        self.needs_l1_buffers = bool(getattr(inner, "needs_l1_buffers", False))
        # A remote inner store gets core's circuit breaker (and its ``call_timeout_s``) as
        # it would unwrapped: only the outermost backend is guarded, so it must say so.
        self.remote = bool(getattr(inner, "remote", False))
        inner_concurrency = getattr(inner, "concurrency", None)
        if inner_concurrency is not None:
            self.concurrency = inner_concurrency
        # One generator per operation kind: the calls of one kind start one after another
        # (one worker thread, or coroutines on one event loop), so the sequence of
        # decisions per kind does not depend on how kinds interleave.  An inner backend
        # with several threads per kind starts its calls in whatever order they win.
        self._random = {
            op: random.Random(f"{config.seed}:{op}") for op in ("store", "lookup", "load", "delete")
        }
        self._fail_rates = {
            "store": config.store_fail_rate,
            "lookup": config.lookup_fail_rate,
            "load": config.load_fail_rate,
            "delete": config.delete_fail_rate,
        }

    def decide(self, op: str, count: int) -> Decision:
        """The delay, the failed keys and (loads) the corruptions of one call of ``op``.

        All are drawn when the call starts: drawn after its delay or its inner call, the
        faults of calls running at once would depend on which of them ends first.
        """
        return Decision(self._delay_of(op), self._failures(op, count), self._corruptions(op, count))

    def _delay_of(self, op: str) -> float:
        """Seconds this call of ``op`` sleeps first (0: none); counted when chosen."""
        config = self.config
        if op in config.delay_ops and config.delay_s > 0 and self._random[op].random() < config.delay_rate:
            self.context.count(f"injected_{op}_delays")
            return config.delay_s
        return 0.0

    def _failures(self, op: str, count: int) -> list[bool]:
        """Which of ``count`` keys fail (True = fail)."""
        rng, rate = self._random[op], self._fail_rates[op]
        if self.config.fail_mode == "keys":
            return [rng.random() < rate for _ in range(count)]
        return [rng.random() < rate] * count

    def _corruptions(self, op: str, count: int) -> list[float | None]:
        """For each of ``count`` keys of a load: where its byte is flipped, None for none.

        Drawn for every key, whether or not it then loads, so the draws of later calls do
        not depend on what the inner adapter answered."""
        rate = self.config.corrupt_rate
        if op != "load" or rate == 0:
            return []
        rng = self._random[op]
        return [rng.random() if rng.random() < rate else None for _ in range(count)]

    def inject(self, op: str, failed: list[bool]) -> list[bool]:
        """Count (and log) the failures a call goes on with; raises them in ``raise`` mode."""
        failures = sum(failed)
        self.context.count(f"injected_{op}_failures", failures)
        if failures:
            self.context.warn(
                f"injected_{op}_failures",
                "injected %s failure of %d/%d keys (fail_mode %s)",
                op,
                failures,
                len(failed),
                self.config.fail_mode,
            )
        if self.config.fail_mode == "raise" and failures:
            raise InjectedFault(f"injected {op} failure")
        return failed

    @staticmethod
    def lookup_answer(failed: list[bool], found: Sequence[Found]) -> list[Found]:
        """The inner backend's answer to a lookup of every key, with the failures applied.

        A failed key is a miss.  The inner backend is asked about it all the same: "absent"
        for a key it holds would make core forget it as removed behind its back (bytes
        released from the usage, the eviction policy told it is gone) while it is still
        stored.  So a failed key that is there fails the whole call instead -- every key
        a miss, none forgotten; one that is not there is a miss either way.
        """
        if any(fail and hit is not None for fail, hit in zip(failed, found, strict=True)):
            raise InjectedFault("injected lookup failure of a stored key")
        return list(found)

    @staticmethod
    def ping_faults(failed: list[bool]) -> None:
        """A ping drawn to fail (counted and logged by ``inject``) raises in every mode: it
        has no per-key answer to carry a miss, and a ping that returns says the store is up."""
        if any(failed):
            raise InjectedFault("injected lookup failure of a ping")

    def load_plan(self, keys: Sequence[ObjectKey], failed: list[bool]) -> list[int]:
        """Positions of the load batch passed to the inner backend: not failed, not chosen
        by ``rate``, not a gap.

        Each key the wrapper takes from a load is one injected fault, counted once: a key
        ``rate`` chose that already failed is not counted again, nor a gap on a key either
        of them took.  Both fail their keys alone in every ``fail_mode``, as LMCache's do:
        each is a hole in the found prefix, never a failed call."""
        config = self.config
        lost = list(failed)
        chosen = [
            i for i, key in enumerate(keys) if not lost[i] and rate_chooses(config.seed, config.rate, key)
        ]
        if chosen:
            for i in chosen:
                lost[i] = True
            self.context.count("injected_rate_failures", len(chosen))
            self.context.warn(
                "injected_rate_failures",
                "injected load failure of %d/%d keys chosen by rate %g (seed %d)",
                len(chosen),
                len(keys),
                config.rate,
                config.seed,
            )
        gaps = gap_positions(len(keys), config.gap_indices, config.gap_tail_ratios)
        gapped = sum(1 for i in gaps if not lost[i])
        if gapped:
            self.context.count("injected_load_gaps", gapped)
            self.context.warn("injected_load_gaps", "injected load gap of %d/%d keys", gapped, len(keys))
        return [i for i, lose in enumerate(lost) if not lose and i not in gaps]

    def corrupted(self, buffer: memoryview, where: float | None) -> bool:
        """Flip the byte drawn for this object, if any; True if the load must report failure."""
        if where is None or buffer.nbytes == 0:
            return False
        buffer[min(int(where * buffer.nbytes), buffer.nbytes - 1)] ^= 0xFF
        self.context.count("injected_corruptions")
        self.context.warn(
            "injected_corruptions",
            "injected corruption: one byte of a loaded object flipped, reported as %s",
            "failed" if self.config.corrupt_detected else "loaded",
        )
        return self.config.corrupt_detected

    def loaded(
        self,
        chosen: list[int],
        answers: Iterable[Any],
        buffers: Sequence[memoryview],
        corruptions: Sequence[float | None],
    ) -> list[Any]:
        """The inner backend's load answers, with corruption applied to its successes.

        An answer goes on as the inner backend gave it unless corruption makes it a
        failure: core accepts only booleans, and turned into one here, a count of bytes
        read (positive even for a short read) would pass for a whole object loaded.
        """
        return [
            False if done and corruptions and self.corrupted(buffers[i], corruptions[i]) else done
            for i, done in zip(chosen, answers, strict=True)
        ]

    @staticmethod
    def spread(count: int, chosen: list[int], results: Iterable[Any], fill: Any) -> list[Any]:
        """Results of the chosen positions in place, ``fill`` elsewhere."""
        out = [fill] * count
        for index, result in zip(chosen, results, strict=True):
            out[index] = result
        return out

    def partial(
        self,
        count: int,
        chosen: list[int],
        exc: PartialFailure,
        buffers: Sequence[memoryview] | None = None,
        corruptions: Sequence[float | None] = (),
    ) -> PartialFailure:
        """The inner backend's ``PartialFailure`` of the chosen keys, as one of the whole batch.

        Its per-key answer is about the keys the inner backend got; passed on as it is,
        core would find it the wrong length and fail every key, so objects the inner
        backend did store would be in no accounting, and those it did remove reported
        still there.  Loads (``buffers``) get their corruption like a returned answer.
        An answer that cannot be placed goes on as it is (core then fails the batch).
        """
        results: Any = exc.results
        try:
            if buffers is not None:
                results = self.loaded(chosen, results, buffers, corruptions)
            results = self.spread(count, chosen, results, False)
        except (TypeError, ValueError):
            pass
        # A new exception either way: raised ``from exc``, the inner one is its cause.
        return PartialFailure(results, str(exc))

    # -- what does not depend on the flavour --------------------------------------------------

    def list_keys(self) -> Any:
        return self.inner.list_keys()

    def capacity(self) -> int | Capacity | None:
        capacity: int | Capacity | None = self.inner.capacity()
        return capacity

    def interrupt(self) -> None:
        interrupt = _optional(self.inner, "interrupt")
        if interrupt is not None:
            interrupt()

    def stats(self) -> dict[str, int]:
        gauges = _optional(self.inner, "stats")
        return {f"inner_{name}": value for name, value in (gauges() if gauges else {}).items()}


class FaultInjectBackend(_FaultInjector):
    """Wraps a backend of plain methods."""

    def __init__(self, config: FaultInjectConfig, context: BackendContext, inner: Any) -> None:
        super().__init__(config, context, inner)
        # Lookups run on helper threads so a stalled inner lookup can be abandoned as a
        # miss (a lookup holds no buffer the inner backend could still write to).
        self._lookups = LeftCallThreads(4, f"l2-{context.name}-inner-lookup")

    def _before(self, op: str, count: int) -> Decision:
        decision = self.decide(op, count)
        if decision.delay and not self.context.sleep(decision.delay):
            return decision._replace(failed=[True] * count)
        return decision._replace(failed=self.inject(op, decision.failed))

    def open(self) -> None:
        opener = _optional(self.inner, "open")
        if opener is not None:
            opener()

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        chosen = [i for i, fail in enumerate(self._before("store", len(keys)).failed) if not fail]
        if not chosen:
            return [False] * len(keys)
        try:
            stored = self.inner.put_many([keys[i] for i in chosen], [payloads[i] for i in chosen])
        except PartialFailure as exc:
            raise self.partial(len(keys), chosen, exc) from exc
        return self.spread(len(keys), chosen, stored, False)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Found]:
        failed = self._before("lookup", len(keys)).failed
        asked = list(keys)
        call = self._lookups.submit(lambda: self._inner_lookup(asked))
        deadline = time.monotonic() + self.config.lookup_timeout_s
        while True:
            try:
                found = call.result(min(_DELAY_POLL_S, max(0.0, deadline - time.monotonic())))
                break
            except FutureTimeout:
                timed_out = time.monotonic() >= deadline
                if timed_out or self.context.closing:
                    # Still queued (every helper thread stuck in the inner backend), it
                    # must not run later: abandoned lookups would pile up while the inner
                    # backend is stuck, and all run before any new one once it answers.
                    call.cancel()
                    if not timed_out:  # given up for the close: no timeout passed
                        self.context.count("inner_lookup_stopped_closing")
                        raise InnerLookupAbandoned(
                            "the adapter closed before the inner adapter answered a lookup"
                        ) from None
                    self.context.count("inner_lookup_timeouts")
                    raise InnerLookupTimeout(
                        f"the inner adapter did not answer a lookup in {self.config.lookup_timeout_s:g} s"
                    ) from None
        return self.lookup_answer(failed, found)

    def _inner_lookup(self, keys: list[ObjectKey]) -> Any:
        # Noted as a read of the keys' records for as long as it runs: given up at
        # lookup_timeout_s it goes on, and may judge what it read after a store of a key
        # landed -- which must count as one that may have replaced that record.
        with self.context.reading_records(keys):
            return self.inner.contains_many(keys)

    def ping(self) -> None:
        """The circuit breaker's probe: the inner adapter's own ping (a redis cluster asks
        every primary; a lookup of one key reaches one node), failing and delayed like a
        lookup; a lookup of the probe key when the inner adapter has no ping."""
        inner_ping = _optional(self.inner, "ping")
        if inner_ping is None:
            self.contains_many([PROBE_KEY])
            return
        self.ping_faults(self._before("lookup", 1).failed)
        inner_ping()

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        decision = self._before("load", len(keys))
        chosen = self.load_plan(keys, decision.failed)
        if not chosen:
            return [False] * len(keys)
        try:
            loaded = self.inner.get_many_into([keys[i] for i in chosen], [buffers[i] for i in chosen])
        except PartialFailure as exc:
            raise self.partial(len(keys), chosen, exc, buffers, decision.corruptions) from exc
        return self.spread(
            len(keys), chosen, self.loaded(chosen, loaded, buffers, decision.corruptions), False
        )

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        chosen = [i for i, fail in enumerate(self._before("delete", len(keys)).failed) if not fail]
        if not chosen:
            return [False] * len(keys)
        try:
            deleted = self.inner.delete_many([keys[i] for i in chosen])
        except PartialFailure as exc:
            raise self.partial(len(keys), chosen, exc) from exc
        return self.spread(len(keys), chosen, deleted, False)

    def close(self) -> None:
        self._lookups.shutdown()
        closer = _optional(self.inner, "close")
        if closer is not None:
            closer()


class AsyncFaultInjectBackend(_FaultInjector):
    """Wraps a backend of coroutines, as coroutines on the same event loop."""

    async def _before(self, op: str, count: int) -> Decision:
        decision = self.decide(op, count)
        end = time.monotonic() + decision.delay
        while decision.delay and (left := end - time.monotonic()) > 0:
            if self.context.closing:
                return decision._replace(failed=[True] * count)
            await asyncio.sleep(min(_DELAY_POLL_S, left))
        return decision._replace(failed=self.inject(op, decision.failed))

    async def open(self) -> None:
        await _maybe_await(_optional(self.inner, "open"))

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        chosen = [i for i, fail in enumerate((await self._before("store", len(keys))).failed) if not fail]
        if not chosen:
            return [False] * len(keys)
        try:
            stored = await self.inner.put_many([keys[i] for i in chosen], [payloads[i] for i in chosen])
        except PartialFailure as exc:
            raise self.partial(len(keys), chosen, exc) from exc
        return self.spread(len(keys), chosen, stored, False)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[Found]:
        failed = (await self._before("lookup", len(keys))).failed
        try:
            found = await asyncio.wait_for(self.inner.contains_many(list(keys)), self.config.lookup_timeout_s)
        except asyncio.TimeoutError:
            self.context.count("inner_lookup_timeouts")
            raise InnerLookupTimeout(
                f"the inner adapter did not answer a lookup in {self.config.lookup_timeout_s:g} s"
            ) from None
        return self.lookup_answer(failed, found)

    async def ping(self) -> None:
        """As the plain flavour's :meth:`FaultInjectBackend.ping`."""
        inner_ping = _optional(self.inner, "ping")
        if inner_ping is None:
            await self.contains_many([PROBE_KEY])
            return
        self.ping_faults((await self._before("lookup", 1)).failed)
        await _maybe_await(inner_ping)

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        decision = await self._before("load", len(keys))
        chosen = self.load_plan(keys, decision.failed)
        if not chosen:
            return [False] * len(keys)
        try:
            loaded = await self.inner.get_many_into([keys[i] for i in chosen], [buffers[i] for i in chosen])
        except PartialFailure as exc:
            raise self.partial(len(keys), chosen, exc, buffers, decision.corruptions) from exc
        return self.spread(
            len(keys), chosen, self.loaded(chosen, loaded, buffers, decision.corruptions), False
        )

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        chosen = [i for i, fail in enumerate((await self._before("delete", len(keys))).failed) if not fail]
        if not chosen:
            return [False] * len(keys)
        try:
            deleted = await self.inner.delete_many([keys[i] for i in chosen])
        except PartialFailure as exc:
            raise self.partial(len(keys), chosen, exc) from exc
        return self.spread(len(keys), chosen, deleted, False)

    async def close(self) -> None:
        await _maybe_await(_optional(self.inner, "close"))


async def _maybe_await(method: Any) -> None:
    if method is not None:
        outcome = method()
        if inspect.isawaitable(outcome):
            await outcome


def open_fault_inject(config: FaultInjectConfig, context: BackendContext) -> _FaultInjector:
    """The factory: build the inner backend, wrap it in the flavour of its methods."""
    inner = context.open_inner(config.inner)
    if config.inner.get("circuit") is not None:
        context.warn(
            "inner_circuit",
            "the circuit breaker of the inner adapter never runs; set `circuit` on the wrapper",
        )
    # A TypeError for an inner backend mixing coroutine and plain batch methods, as core
    # refuses it unwrapped: wrapped in the flavour of one method, the others' calls would fail.
    if is_async_backend(inner):
        return AsyncFaultInjectBackend(config, context, inner)
    return FaultInjectBackend(config, context, inner)
