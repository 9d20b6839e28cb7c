"""What ``lmcache bench server`` meets when the server restarts under it.

The bench never pings, so it never registers again: to the new server process its
connection (ZeroMQ reconnects with a new identity) is one that registered nothing.  Its
lookups answer 0 hits and its next ``prepare_store`` is not answered, so the bench stops
with its own timeout (``PREPARE_STORE timed out``, exit code 1), as against a restarted
LMCache 0.5.6 server; docs/frontends/lmcache-mp.md says so.  (The reference bench carried
over a real restart is run in tests/server/test_lmcache_client_restarts.py.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from mp_counts import mp_stats
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

DOC = Path(__file__).resolve().parents[3] / "docs" / "frontends" / "lmcache-mp.md"
REG = Registration()


def test_a_bench_carried_over_a_restart_misses_and_gets_no_answer_to_its_store(
    make_mp_server: Callable[..., TiersServer],
) -> None:
    before = make_mp_server()
    with MPClient(mp_address(before)) as bench:
        shm = bench.register(REG)["shm_name"]
        key = Key(tokens_of(1), "req-1-cold", worker_id=0)
        assert bench.store(key, REG.instance_id, chunk_payloads(1, 4, REG.object_bytes), shm)
        assert bench.lookup(Key(tokens_of(1), "req-1-warm")) == 4
    after = make_mp_server()
    with MPClient(mp_address(after)) as carried_over:
        assert carried_over.lookup(Key(tokens_of(2), "req-2-cold")) == 0
        store = Key(tokens_of(2), "req-2-cold", worker_id=0)
        assert carried_over.unanswered("prepare_store", store.encode(), REG.instance_id)
    assert mp_stats(after).failures["mp_unregistered_instance"] == 1


def test_the_doc_says_a_bench_run_over_a_restart_stops_at_its_next_store() -> None:
    text = " ".join(DOC.read_text().split())
    (sentence,) = re.findall(r"`lmcache bench server` never pings[^;]*;", text)
    assert "next `prepare_store` is not answered (`mp_unregistered_instance`" in sentence
    assert "PREPARE_STORE timed out" in sentence and "exit code 1" in sentence
