"""Acknowledged stores against an L2 that fails some stores and is slow with others, while a
small L1 evicts: every acknowledged chunk is in L1, in L2, or counted (and logged) as not
stored -- under each shipped store policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiers_e2e import digest, make_keys, make_payloads, start_server
from trust_jobs import failures_in_metrics, wait_for_l2_stores

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.wire.protocol import ErrorCode

SIZE = 64 << 10  # 32 objects fill the 2 MiB L1
BATCH = 4
#: reasons under which an acknowledged chunk may be missing from both tiers
NOT_STORED = ("l2_store_failed", "evicted_before_l2_store", "l1_cleared_before_l2_store")


@pytest.mark.parametrize("policy", ["default", "skip_l1"])
def test_every_acknowledged_chunk_is_served_or_counted_as_not_stored(tmp_path: Path, policy: str) -> None:
    faulty = {
        "type": "fault_inject",
        "inner": {"type": "fs", "path": str(tmp_path / "l2")},
        "seed": 3,
        "store_fail_rate": 0.3,
        "delay_s": 0.2,
        "delay_rate": 0.5,
        "delay_ops": ["store"],
    }
    server = start_server(tmp_path / "server", adapters=[faulty], l2_store_policy=policy, l1_size_gb=2 / 1024)
    try:
        acknowledged: list[str] = []
        refused = 0
        with Client(server.url, timeout=30) as client:
            for batch in range(40):
                tag = f"ack/{batch}"
                keys, data = make_keys(tag, BATCH), make_payloads(tag, BATCH, SIZE)
                try:
                    stored = client.store(keys, data)
                except ServerError as exc:
                    # L1 full of chunks waiting for their slow stores: refused, nothing
                    # acknowledged.  Once those stores ended, L1 can make room.
                    assert exc.code is ErrorCode.OUT_OF_MEMORY
                    refused += 1
                    wait_for_l2_stores(client)
                    stored = client.store(keys, data)
                assert stored == BATCH
                acknowledged.append(tag)
            wait_for_l2_stores(client)
            missing = 0
            for tag in acknowledged:
                keys, data = make_keys(tag, BATCH), make_payloads(tag, BATCH, SIZE)
                for key, payload in zip(keys, data, strict=True):
                    if client.lookup([key], timeout=30) == 0:
                        missing += 1
                        continue
                    with client.retrieve([key]) as views:
                        assert digest(views) == digest([payload]), f"wrong bytes for {tag}"
        failures = failures_in_metrics(server.http_url)
        assert failures.get("l2_store_failed", 0) > 0, "no store failed: the faults did not bite"
        print(f"\n{policy}: {refused} stores refused then retried, {missing} chunks missing, {failures}")
        assert missing <= sum(failures.get(reason, 0) for reason in NOT_STORED), failures
    finally:
        assert server.stop() == 0, server.output()
    assert "keys were not stored in 0:fault_inject" in server.output()
