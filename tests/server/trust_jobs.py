"""Client jobs of the trust tests (acknowledged stores, prefetch results), run in spawned
processes like engines; module-level so that ``spawn`` children can import them."""

from __future__ import annotations

import hashlib
import re
import time
import urllib.request
from typing import Any

from tiers_e2e import digest, make_keys, make_payloads

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.wire.protocol import ErrorCode


def job_acknowledged_storm(url: str, worker: int, size: int, batches: int, batch: int) -> dict[str, Any]:
    """Store ``batches`` batches of fresh chunks as fast as possible; returns the tags of
    the batches the server acknowledged (every key stored) and how many it refused."""
    acknowledged: list[str] = []
    refused = 0
    with Client(url, shm=worker % 2 == 0, timeout=30) as client:
        for index in range(batches):
            tag = f"acked{worker}/{index}"
            try:
                stored = client.store(make_keys(tag, batch), make_payloads(tag, batch, size))
            except ServerError as exc:
                if exc.code is not ErrorCode.OUT_OF_MEMORY:
                    raise
                refused += 1  # L1 full of objects being stored: nothing acknowledged
                continue
            if stored != batch:
                raise AssertionError(f"worker {worker}: {stored} of {batch} fresh keys stored")
            acknowledged.append(tag)
    return {"acknowledged": acknowledged, "refused": refused}


def job_lookups(url: str, worker: int, prompts: int, chunks: int, size: int, rounds: int) -> dict[str, int]:
    """``rounds`` lookups of stored prompts (mostly served from L2), each checked byte for
    byte and released; NOT_FOUND from a lookup is a failure of the server, not a miss."""
    expected = {prompt: digest(make_payloads(f"lk/{prompt}", chunks, size)) for prompt in range(prompts)}
    counts = {"lookups": 0, "hits": 0, "misses": 0}
    with Client(url, shm=worker % 2 == 0, timeout=60) as client:
        for round_index in range(rounds):
            prompt = int.from_bytes(hashlib.blake2b(f"{worker}/{round_index}".encode()).digest()[:4], "big")
            prompt %= prompts
            keys = make_keys(f"lk/{prompt}", chunks)
            hits = client.lookup(keys, timeout=60)
            counts["lookups"] += 1
            counts["hits"] += hits
            counts["misses"] += hits < chunks
            with client.retrieve(keys[:hits]) as views:
                if len(views) != hits:
                    raise AssertionError(f"lookup said {hits} hits, retrieve gave {len(views)}")
                if digest(views) != expected[prompt][:hits]:
                    raise AssertionError(f"prompt {prompt}: retrieved bytes differ")
    return counts


def wait_for_l2_stores(client: Client, timeout: float = 60.0) -> None:
    """Until the server's store controller has nothing queued or in flight."""
    deadline = time.monotonic() + timeout
    while True:
        store = client.status()["store"]
        if store["in_flight_tasks"] == 0 and store["pending_batches"] == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"L2 stores did not drain within {timeout}s: {store}")
        time.sleep(0.05)


def failures_in_metrics(http_url: str) -> dict[str, float]:
    """``lmcache_tiers_failures_total`` by reason, as a scraper sees it."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^lmcache_tiers_failures_total\{reason="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {reason: float(value) for reason, value in found}
