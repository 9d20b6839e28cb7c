"""The latency percentiles ``lmcache-tiers bench`` reports are nearest rank, as replay's."""

from __future__ import annotations

import pytest

from lmcache_tiers.server import benchmark


@pytest.mark.parametrize(
    ("samples", "fraction", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),  # the 2nd of 4, not the 3rd
        ([float(n) for n in range(1, 1001)], 0.5, 500.0),  # a ping p50 of 1000 samples
        ([float(n) for n in range(1, 101)], 0.99, 99.0),  # p99 of 100 is not their maximum
        ([float(n) for n in range(1, 11)], 0.99, 10.0),
        ([7.0], 0.99, 7.0),
    ],
)
def test_bench_percentiles_are_nearest_rank(samples: list[float], fraction: float, expected: float) -> None:
    # round(q * (n - 1)) as the index put p50 of 1..4 at 3 and of 1000 pings one rank high.
    assert benchmark.percentile(samples, fraction) == expected
