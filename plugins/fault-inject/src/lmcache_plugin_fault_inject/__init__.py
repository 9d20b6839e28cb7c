"""L2 adapter ``fault_inject``: any adapter, with failures injected on purpose."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from lmcache_tiers.plugin import FieldError, KindRegistry, L2AdapterConfig, hookimpl

Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Op = Literal["store", "lookup", "load", "delete"]


def _rate(description: str) -> msgspec.Meta:
    """A probability in [0, 1], documented."""
    return msgspec.Meta(ge=0.0, le=1.0, description=description)


class FaultInjectConfig(L2AdapterConfig):
    """Wraps the adapter given as ``inner`` and injects faults into its operations.

    The inner adapter's backend runs inside this adapter: one set of tasks, pins and
    byte accounting (its counters show in ``stats()`` as ``inner_<name>``).

    Its purpose is to drive every failure path of the controllers.  The wrapper's own
    ``serde`` chain wraps the inner one; ``eviction`` and ``circuit`` belong on the
    wrapper (the inner adapter is not visible to the controllers); a remote inner adapter
    puts the wrapper behind a circuit breaker by default, as it would be itself.

    ``rate``, ``seed``, ``gap_indices`` and ``gap_tail_ratios`` mean what they mean in
    LMCache's adapter: ``rate`` is the share of keys whose loads fail, each key chosen by
    a hash of the key and ``seed`` -- a chosen key is found by lookups and fails every
    load, in every process given the same seed; no other operation is affected.  Its
    failures are per key in every ``fail_mode``: each leaves a hole in the found prefix.

    Every other fault is drawn at random, seeded by ``seed`` (one generator per
    operation kind), as each call starts, so a run with the same calls injects the same
    faults -- unless the inner adapter runs calls of one kind on several worker threads
    (redis's and mooncake's ``num_workers`` over 1): then which of the calls running at
    once gets which faults follows which thread starts first.

    Failures: each operation kind fails with its ``*_fail_rate`` (0 unless given).
    ``fail_mode`` says what failing means: ``keys`` -- each key fails independently with
    the rate (a failed store is not stored, a failed lookup is a miss, a failed load leaves
    its buffer untouched); ``batch`` -- the whole call fails with the rate; ``raise`` -- the
    backend call raises with the rate (the adapter turns that into a failed batch and
    counts a backend error).  A lookup with a failed key the inner adapter holds raises
    in every mode: answered absent, that key would be forgotten (usage, eviction) while
    the inner adapter still holds it.  Every injected fault is counted in ``stats()`` (and
    so in ``/metrics``): ``injected_<op>_failures`` (keys), ``injected_rate_failures``
    (keys of loads ``rate`` chose, not already failed), ``injected_load_gaps`` (keys
    not already failed), ``injected_corruptions``, ``injected_<op>_delays`` (calls); the
    failures, gaps and corruptions are also logged.  ``inner_lookup_timeouts`` counts
    lookups abandoned after ``lookup_timeout_s``, ``inner_lookup_stopped_closing`` those
    given up earlier because the adapter closed (a plain inner adapter's lookups).

    Pings: the circuit breaker's probe reaches the inner adapter's own ``ping`` (a redis
    cluster pings every primary), delayed and failed like a lookup (``lookup_fail_rate``,
    ``delay_ops``); a ping drawn to fail raises in every ``fail_mode``.  Without an inner
    ``ping`` the probe is a lookup of one key through this wrapper.

    Gaps: ``gap_indices`` and ``gap_tail_ratios`` always fail given positions of every
    load batch (the keys the backend call receives, in prefix order), so the found prefix
    has a hole: ``gap_indices`` counts from the head (negative values count from the
    tail, an addition: LMCache refuses them); a tail ratio ``r`` drops position
    ``round((1 - r) * (n - 1))`` -- 0.0 is the last key, 0.5 the middle one, 1.0 the
    first -- whatever the batch length.

    Corruption: with ``corrupt_rate`` a successfully loaded object gets one byte flipped
    in the L1 buffer.  ``corrupt_detected`` true reports that key as failed -- what an
    adapter that verifies record checksums does; false reports success with the wrong
    bytes -- silent corruption that only an end-to-end check catches (e.g. an
    authenticating serde configured on this wrapper, which then turns it into a miss).
    Corruption is applied to loaded bytes, not to the inner adapter's stored records.

    Delays: each call of an operation in ``delay_ops`` sleeps ``delay_s`` first with
    probability ``delay_rate``.  Sleeps end early when the adapter closes.
    """

    inner: Annotated[
        dict[str, Any],
        msgspec.Meta(description='The wrapped adapter\'s spec: a JSON object with its own "type".'),
    ]
    seed: Annotated[
        int,
        msgspec.Meta(description="Seed of the hash that picks `rate`'s keys and of every random draw."),
    ] = 0
    rate: Annotated[
        float,
        _rate(
            "Share of keys whose loads fail, as LMCache's: chosen by a hash of the key and `seed` "
            "(such a key fails every load); stores and lookups are not affected."
        ),
    ] = 0.0
    store_fail_rate: Annotated[float, _rate("Failure probability of stores.")] = 0.0
    lookup_fail_rate: Annotated[float, _rate("Failure probability of lookups.")] = 0.0
    load_fail_rate: Annotated[
        float, _rate("Failure probability of loads, drawn per call (on top of `rate` and gaps).")
    ] = 0.0
    delete_fail_rate: Annotated[float, _rate("Failure probability of deletes (eviction).")] = 0.0
    fail_mode: Annotated[
        Literal["keys", "batch", "raise"],
        msgspec.Meta(description="What a failure is: per key, the whole call, or the call raising."),
    ] = "keys"
    gap_indices: Annotated[
        tuple[int, ...],
        msgspec.Meta(description="Load positions that always fail, from the head (negative: from the tail)."),
    ] = ()
    gap_tail_ratios: Annotated[
        tuple[Rate, ...],
        msgspec.Meta(
            description="Load positions that always fail: round((1 - r) * (n - 1)); 0.0 = last key."
        ),
    ] = ()
    corrupt_rate: Annotated[float, _rate("Probability that a loaded object gets one byte flipped.")] = 0.0
    corrupt_detected: Annotated[
        bool, msgspec.Meta(description="Report corrupted loads as failures (true) or as successes (false).")
    ] = True
    delay_s: Annotated[
        float, msgspec.Meta(ge=0.0, le=3600.0, description="Seconds a delayed call sleeps before running.")
    ] = 0.0
    delay_rate: Annotated[float, _rate("Probability that a call of a delayed operation is delayed.")] = 1.0
    delay_ops: Annotated[
        tuple[Op, ...], msgspec.Meta(description="Operations whose calls may be delayed.")
    ] = ("store", "lookup", "load")
    lookup_timeout_s: Annotated[
        float,
        msgspec.Meta(
            gt=0.0,
            le=3600.0,
            description="How long a lookup waits for the inner adapter before it counts as a miss "
            "(stores and loads always wait: the inner adapter may still use their buffers).",
        ),
    ] = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.inner.get("type"), str):
            raise FieldError("inner", '`inner` must be an adapter spec with a string "type"')


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("fault_inject", "lmcache_plugin_fault_inject.backend:open_fault_inject", FaultInjectConfig)
