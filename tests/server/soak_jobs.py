"""Client jobs of the mixed-client soak (tests/server/test_mixed_soak.py), run in spawned
processes like engines; module-level so that ``spawn`` children can import them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tiers_e2e import digest, make_keys, make_payloads

from lmcache_tiers.client import Client, ServerError, StaleReadError
from lmcache_tiers.wire.protocol import ErrorCode


def prompt_tag(worker: int, round_index: int) -> str:
    return f"soak{worker}/{round_index}"


def check_prompt(client: Client, tag: str, chunks: int, size: int) -> tuple[int, bool]:
    """Look up a prompt, retrieve its hit prefix and compare every byte with what its key
    says it holds; returns (chunks checked, whether the read came up short: a forced clear
    took objects away or moved an extent under the views).  Wrong bytes raise."""
    keys, expected = make_keys(tag, chunks), digest(make_payloads(tag, chunks, size))
    hits = client.lookup(keys, timeout=60)
    try:
        with client.retrieve(keys[:hits]) as views:
            got = digest(views)
    except StaleReadError:
        return hits, True  # the client said the views are void: nothing was trusted
    # A forced clear between the lookup and the retrieve takes the looked-up objects out
    # of L1: the retrieve then gives a shorter prefix (a miss), never other bytes.
    if len(got) > hits:
        raise AssertionError(f"{tag}: lookup said {hits} hits, retrieve gave {len(got)}")
    if got != expected[: len(got)]:
        raise AssertionError(f"{tag}: retrieved bytes differ from the stored ones")
    return len(got), len(got) < hits


def earlier_round(worker: int, round_index: int) -> int:
    """A deterministic earlier round of this worker (often evicted from L1 by now)."""
    draw = int.from_bytes(hashlib.blake2b(f"{worker}/{round_index}".encode(), digest_size=4).digest(), "big")
    return draw % round_index


def store_and_check(
    client: Client, tag: str, earlier: str | None, chunks: int, size: int, counts: dict[str, int]
) -> bool:
    """Store the prompt ``tag``, then check it and the prompt ``earlier`` (if any) byte for
    byte, adding refusals, partial stores, hits and short reads to ``counts``; True when
    every chunk of the store was acknowledged."""
    try:
        stored = client.store(make_keys(tag, chunks), make_payloads(tag, chunks, size))
    except ServerError as exc:
        if exc.code is not ErrorCode.OUT_OF_MEMORY:
            raise
        counts["refused"] += 1  # nothing of the batch was acknowledged
        stored = 0
    if stored and stored != chunks:
        counts["partial"] += 1
    for checked in [tag] + ([earlier] if earlier is not None else []):
        hits, short = check_prompt(client, checked, chunks, size)
        counts["hits"] += hits
        counts["short_reads"] += short
    return stored == chunks


def job_soak_client(url: str, worker: int, rounds: int, chunks: int, size: int, marks: str) -> dict[str, Any]:
    """A busy engine: each round stores a fresh prompt, checks it and an earlier one byte
    for byte, sometimes looks a prompt up and releases it without reading, sometimes
    evicts the tail of an old prompt from L1.  Half-way it leaves a file in ``marks``."""
    acknowledged: list[str] = []
    counts = {"refused": 0, "partial": 0, "hits": 0, "short_reads": 0, "evicted": 0, "released": 0}
    with Client(url, shm=worker % 2 == 0, timeout=60) as client:
        for round_index in range(rounds):
            tag = prompt_tag(worker, round_index)
            earlier = prompt_tag(worker, earlier_round(worker, round_index)) if round_index else None
            if store_and_check(client, tag, earlier, chunks, size, counts):
                acknowledged.append(tag)
            if round_index % 3 == 2:
                old = make_keys(prompt_tag(worker, round_index - 2), chunks)
                client.lookup(old, timeout=60)
                counts["released"] += client.release(old)
            if round_index % 4 == 3:
                counts["evicted"] += client.evict(
                    make_keys(prompt_tag(worker, round_index - 3), chunks)[chunks // 2 :]
                )
            if round_index == rounds // 2:
                Path(marks, str(worker)).touch()
    return {"acknowledged": acknowledged, **counts}
