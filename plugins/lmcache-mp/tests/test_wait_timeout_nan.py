"""A ``wait_prefetch_status`` whose timeout is NaN is refused (``mp_bad_request``, not
answered, as LMCache's server raises on it), where its wait spun on a pool thread with no
pause for as long as the lookup's prefetch from L2 ran."""

from __future__ import annotations

from typing import Any

import msgspec
from mp_counts import mp_stats
from mp_slow_l2 import SLOW_L2
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

REG = Registration()


def test_a_wait_with_a_nan_timeout_is_refused(make_mp_server: Any) -> None:
    server = make_mp_server(adapters=SLOW_L2, lookup_wait_ms=0)
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        payloads = chunk_payloads(5, 4, REG.object_bytes)
        assert client.store(Key(tokens_of(5), "s", worker_id=0), REG.instance_id, payloads, shm)
        assert server.storage.flush(timeout=60)
        assert client.call("clear", True) is None
        client.call("lookup", Key(tokens_of(5), "w").encode(), 1)
        nan_wait = client.send("wait_prefetch_status", "w", float("nan"))
        # A wait with a timeout answers when the prefetch ends, which is when a wait that
        # spun would answer too: no reply to the NaN one may come before it, nor just after.
        wait = client.send("wait_prefetch_status", "w", 30.0)
        before: list[bytes] = []
        while True:
            assert client.socket.poll(30_000), "the wait with a timeout was not answered"
            frames = client.socket.recv_multipart()
            if frames[0] == wait:
                break
            before.append(frames[0])
        assert nan_wait not in before, "the wait with a NaN timeout was answered"
        assert msgspec.msgpack.decode(frames[2]) == 4  # the lookup itself stands
        assert client.no_reply_to(nan_wait), "the wait with a NaN timeout was answered"
        assert mp_stats(server).failures["mp_bad_request"] == 1
