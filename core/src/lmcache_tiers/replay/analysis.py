"""``replay --simulate`` analysis options: oracles with foresight, and the re-timed model.

``--foresight H,...`` adds ``NextUseOracle`` runs (``foresight.py``) to the simulation;
``--retime SEED`` replaces the trace by a re-timed sample of its Poisson model
(``retime.py``), adds the ``rate oracle`` run and reports the bound no online policy can
beat on that model.  The oracles know the trace: their figures are limits, not policies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_tiers.policies import EvictionPolicy
from lmcache_tiers.replay.foresight import foresight_factories
from lmcache_tiers.replay.retime import RATE_ORACLE, RateOracle, Retimed, best_bandwidth, rate_bound, retime
from lmcache_tiers.replay.trace import Trace


@dataclass(frozen=True)
class AnalysisOptions:
    foresight: Sequence[int | None] = ()
    retime_seed: int | None = None
    #: kernel bandwidth in requests; None: the likeliest one
    retime_bandwidth: int | None = None


@dataclass
class Analysis:
    """The trace to simulate (re-timed or not) and the oracle runs to add to it."""

    trace: Trace
    factories: dict[str, Callable[[], EvictionPolicy]] = field(default_factory=dict)
    sample: Retimed | None = None
    #: the model's expected block references (the original trace's)
    expected_references: int = 0

    @property
    def oracles(self) -> list[str]:
        return list(self.factories)

    def online_bound(self, capacities: Sequence[int]) -> dict[int, float] | None:
        """Per L1 capacity, the bound on any online policy's expected hit rate (re-timed only)."""
        if self.sample is None:
            return None
        return rate_bound(self.sample, capacities, self.expected_references)

    def describe(self) -> dict[str, Any]:
        if self.sample is None:
            return {"oracles": self.oracles}
        return {
            "oracles": self.oracles,
            "retimed": {
                "seed": self.sample.seed,
                "bandwidth_requests": self.sample.model.bandwidth,
                "requests": len(self.trace.requests),
                "block_references": self.trace.block_references,
                "expected_block_references": self.expected_references,
            },
        }


def prepare(trace: Trace, options: AnalysisOptions) -> Analysis:
    analysis = Analysis(trace, expected_references=trace.block_references)
    if options.retime_seed is not None:
        bandwidth = options.retime_bandwidth or best_bandwidth(trace)
        sample = retime(trace, float(bandwidth), options.retime_seed)
        analysis.trace, analysis.sample = sample.trace, sample

        def rate_oracle() -> EvictionPolicy:
            return RateOracle(sample)

        analysis.factories[RATE_ORACLE] = rate_oracle
    for name, factory in foresight_factories(analysis.trace, options.foresight).items():
        analysis.factories[name] = factory
    return analysis
