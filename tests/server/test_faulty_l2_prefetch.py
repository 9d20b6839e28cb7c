"""Lookups and stops against an L2 that fails, stalls or both (``fault_inject`` over ``fs``),
alone and in front of a healthy second adapter, under each shipped prefetch policy."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import ServerProcess, digest, make_keys, make_payloads, start_server
from trust_jobs import failures_in_metrics, wait_for_l2_stores

from lmcache_tiers.client import Client, RequestTimeoutError

SIZE = 16 << 10
CHUNKS = 8
PREFETCH_POLICIES = ("default", "retain")


def faulty(path: Path, **faults: Any) -> dict[str, Any]:
    return {"type": "fault_inject", "inner": {"type": "fs", "path": str(path)}, **faults}


def stored_in_l2_only(server: ServerProcess, tag: str) -> tuple[list[Any], list[Any]]:
    """Store one prompt, wait until L2 has it, and empty L1: its lookups go to L2."""
    keys, data = make_keys(tag, CHUNKS), make_payloads(tag, CHUNKS, SIZE)
    with Client(server.url, timeout=30) as client:
        assert client.store(keys, data) == CHUNKS
        wait_for_l2_stores(client)
        assert client.clear() == CHUNKS
    return keys, data


def adapter_counts(client: Client, name: str) -> list[int]:
    return [int(adapter[name]) for adapter in client.status()["adapters"]]


def assert_nothing_held(client: Client) -> None:
    status = client.status()
    assert status["l1"]["read_locks"] == 0
    assert status["l1"]["write_locked"] == 0
    assert [adapter["backend"]["pinned_keys"] for adapter in status["adapters"]] == [0] * len(
        status["adapters"]
    )


@pytest.mark.parametrize(
    ("policy", "healthy_second"), [("default", False), ("retain", True)], ids=["alone", "healthy-second"]
)
def test_a_chunk_that_fails_to_load_ends_the_prefix_unless_another_adapter_has_it(
    tmp_path: Path, policy: str, healthy_second: bool
) -> None:
    adapters = [faulty(tmp_path / "l2-faulty", gap_indices=[3])]
    if healthy_second:
        adapters.append({"type": "fs", "path": str(tmp_path / "l2-healthy")})
    server = start_server(tmp_path / "server", adapters=adapters, l2_prefetch_policy=policy)
    try:
        keys, data = stored_in_l2_only(server, "gap")
        expected = CHUNKS if healthy_second else 3
        with Client(server.url, timeout=30) as client:
            assert client.lookup(keys, timeout=30) == expected
            with client.retrieve(keys) as views:  # nothing past the prefix promised
                assert digest(views) == digest(data[:expected])
            assert_nothing_held(client)
        failures = failures_in_metrics(server.http_url)
        assert failures.get("l2_load_failed") == 1
        assert failures.get("l2_load_fallback", 0) == (1 if healthy_second else 0)
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.parametrize("policy", PREFETCH_POLICIES)
def test_overlapping_lookups_behind_slow_loads_load_each_chunk_once(tmp_path: Path, policy: str) -> None:
    """Clients look up overlapping prefixes of one prompt at once, with one prefetch slot
    and loads that take a second: a prefetch waits for the one loading its keys and takes
    them from L1, so L2 loads each chunk once, and every lookup gets what it promised."""
    adapters = [faulty(tmp_path / "l2", delay_s=1.0, delay_ops=["load"])]
    server = start_server(
        tmp_path / "server", adapters=adapters, l2_prefetch_policy=policy, l2_prefetch_max_in_flight=1
    )
    try:
        keys, data = stored_in_l2_only(server, "overlap")
        lengths = (3, 8, 5, 4, 8, 6)
        clients = [Client(server.url, timeout=30) for _ in lengths]
        hits: dict[int, int] = {}
        errors: list[BaseException] = []
        impatient = Client(server.url, timeout=30)
        try:

            def look(index: int) -> None:
                try:
                    hits[index] = clients[index].lookup(keys[: lengths[index]], timeout=60)
                except BaseException as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=look, args=(index,)) for index in range(len(lengths))]
            for thread in threads:
                thread.start()
            # A lookup that cannot wait for a load of a second gives up at its own timeout.
            with pytest.raises(RequestTimeoutError):
                impatient.lookup(make_keys("overlap", CHUNKS)[:2] + make_keys("other", 1), timeout=0.2)
            for thread in threads:
                thread.join(120)
            assert not errors, errors
            assert hits == dict(enumerate(lengths)), "every lookup is a full hit"
            # The clients still hold their prefixes: nothing was freed and loaded again.
            assert adapter_counts(clients[0], "keys_loaded") == [CHUNKS]
            for client, length in zip(clients, lengths, strict=True):
                with client.retrieve(keys[:length]) as views:
                    assert digest(views) == digest(data[:length])
        finally:
            for client in clients:
                client.close()
            impatient.close()
        assert "l2_load_failed" not in failures_in_metrics(server.http_url)
    finally:
        assert server.stop() == 0, server.output()


def prefetch_state(client: Client) -> tuple[int, int]:
    """(running, queued) prefetch requests, as `/status` reports them."""
    prefetch = client.status()["prefetch"]
    return prefetch["in_flight"], prefetch["queued"]


def test_a_stop_counts_the_prefetches_it_abandons(tmp_path: Path) -> None:
    """SIGTERM with a prefetch loading and two queued behind it (one slot), held up by an
    L2 whose loads stall for minutes: the stop ends at its deadlines and says what it gave
    up -- the queued requests too, each a lookup it turned into a miss."""
    adapters = [faulty(tmp_path / "l2", delay_s=600.0, delay_ops=["load"])]
    server = start_server(
        tmp_path / "server", adapters=adapters, l2_prefetch_max_in_flight=1, shutdown_timeout_s=0.5
    )
    try:
        keys, _ = stored_in_l2_only(server, "stop")
        with Client(server.url, timeout=30) as client:
            assert client.start_lookup(keys)[1] is None
            for length in (3, 5):  # their keys are the running one's: they queue behind it
                assert client.start_lookup(keys[:length])[1] is None
            # The controller takes a queued request into its one slot a moment after the
            # lookup returns: all three can be seen queued first.
            deadline = time.monotonic() + 30
            while (state := prefetch_state(client)) != (1, 2):
                assert time.monotonic() < deadline, state
                time.sleep(0.05)
            # Stopped with the client still connected: a session's end discards its
            # prefetches, and a queued one discarded leaves the queue at once.
            assert server.stop() == 0, server.output()  # nothing acknowledged was lost
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    output = server.output()
    # The front end gives its clients' prefetches back at the stop: the two queued leave
    # the queue then, counted, before the controller's stop gives up on the running one.
    assert "failure reason prefetch_discarded_queued" in output
    assert "queued prefetch requests abandoned at the stop" not in output
    assert re.search(r"prefetch request \d+ abandoned \(prefetch_abandoned\)", output), "the running one"
