"""A ``wait_prefetch_status`` whose timeout is NaN is refused (``mp_bad_request``, not
answered, as LMCache's server raises on it), where its wait spun on a pool thread with no
pause for as long as the lookup's prefetch from L2 ran."""

from __future__ import annotations

import json
from typing import Any

from mp_counts import mp_stats
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

REG = Registration()
#: an L2 whose lookups and loads take a second: the prefetch is running when the wait comes
SLOW_L2 = [json.dumps({"type": "mock", "max_size_gb": 0.1, "latency_s": 1.0})]


def test_a_wait_with_a_nan_timeout_is_refused(make_mp_server: Any) -> None:
    server = make_mp_server(adapters=SLOW_L2, lookup_wait_ms=0)
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        payloads = chunk_payloads(5, 4, REG.object_bytes)
        assert client.store(Key(tokens_of(5), "s", worker_id=0), REG.instance_id, payloads, shm)
        assert server.storage.flush(timeout=60)
        assert client.call("clear", True) is None
        client.call("lookup", Key(tokens_of(5), "w").encode(), 1)
        # long enough for the prefetch to end: a wait that spun answers by then
        assert client.unanswered("wait_prefetch_status", "w", float("nan"), wait_ms=5000)
        assert mp_stats(server).failures["mp_bad_request"] == 1
        assert client.call("wait_prefetch_status", "w", 30.0) == 4  # the lookup itself stands
