import time

import numpy as np
import pytest

from lmcache_tiers.replay.run import Payloads, ReplayTotals, paced, percentile, status_delta
from lmcache_tiers.replay.trace import TraceRequest


def _requests(*stamps: float) -> list[tuple[int, TraceRequest]]:
    return [(index, TraceRequest(stamp, 600, 1, (index,))) for index, stamp in enumerate(stamps)]


def test_time_scale_zero_sends_everything_at_once() -> None:
    requests = _requests(0, 10_000, 20_000)
    assert list(paced(requests, 0.0, origin_ms=0, start=time.monotonic())) == requests


def test_arrivals_are_not_sent_before_they_are_due() -> None:
    requests = _requests(1000, 1060, 1120)
    start = time.monotonic()
    seen = []
    for index, _ in paced(requests, 1.0, origin_ms=1000, start=start):
        seen.append((index, time.monotonic() - start))
    assert [index for index, _ in seen] == [0, 1, 2]
    for (index, elapsed), due in zip(seen, (0.0, 0.06, 0.12), strict=True):
        assert elapsed >= due - 1e-3, f"request {index} sent {due - elapsed:.3f}s early"


def test_payloads_carry_their_block_id() -> None:
    payloads = Payloads(64)
    first, second = payloads.batch([7, 2**63 + 5])
    assert payloads.matches(7, memoryview(first)) and payloads.matches(2**63 + 5, memoryview(second))
    assert not payloads.matches(8, memoryview(first))
    assert not payloads.matches(7, memoryview(np.zeros(32, dtype=np.uint8)))
    with pytest.raises(ValueError):
        Payloads(8)


def test_totals_add_up_across_clients() -> None:
    one, two = ReplayTotals(hit_blocks=3, seconds=2.0), ReplayTotals(hit_blocks=4, seconds=5.0)
    one.lookup_latencies_s.append(0.1)
    two.lookup_latencies_s.append(0.2)
    one.merge(two)
    assert (one.hit_blocks, one.seconds, one.lookup_latencies_s) == (7, 5.0, [0.1, 0.2])


def test_percentiles() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(n) for n in range(100)], 0.99) == 99.0


def test_status_delta_counts_only_what_changed() -> None:
    before = {
        "requests": {"l1_hit_chunks": 5, "l2_hit_chunks": 1},
        "eviction": {"l1": {"evicted_keys": 2}},
        "adapters": [{"keys_stored": 10, "keys_loaded": 1, "keys_evicted": 0}],
        "failures": {"l2_store_failed": 3},
    }
    after = {
        "requests": {"l1_hit_chunks": 9, "l2_hit_chunks": 4},
        "eviction": {"l1": {"evicted_keys": 7}},
        "adapters": [{"keys_stored": 15, "keys_loaded": 3, "keys_evicted": 1}],
        "failures": {"l2_store_failed": 3, "l1_write_oom": 2},
    }
    assert status_delta(before, after) == {
        "l1_hit_blocks": 4,
        "l2_hit_blocks": 3,
        "l1_evicted_blocks": 5,
        "l2_stored_blocks": 5,
        "l2_loaded_blocks": 2,
        "l2_evicted_blocks": 1,
        "failures": {"l1_write_oom": 2},
    }
