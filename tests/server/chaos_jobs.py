"""Client jobs of the chaos soak (tests/server/test_chaos_soak.py), run in spawned
processes like engines; module-level so that ``spawn`` children can import them.

The test says which phase of the chaos it is in through a file (``phase``); a client
reads it before each store, so a prompt's phase is one the chaos had reached before the
prompt was stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from soak_jobs import earlier_round, store_and_check

from lmcache_tiers.client import Client


def chaos_tag(worker: int, round_index: int) -> str:
    return f"chaos{worker}/{round_index}"


def job_chaos_client(url: str, worker: int, chunks: int, size: int, control: str) -> dict[str, Any]:
    """Store a fresh prompt per round, check it and an earlier one byte for byte, until the
    file ``stop`` appears in ``control``.  After each round it writes ``progress/<worker>``
    (the phase and how many rounds this worker finished in it).  Wrong bytes raise."""
    folder = Path(control)
    acknowledged: list[tuple[str, str]] = []  # (tag, phase read before its store)
    counts = {"refused": 0, "partial": 0, "hits": 0, "short_reads": 0}
    rounds_in_phase: dict[str, int] = {}
    round_index = 0
    with Client(url, shm=worker % 2 == 0, timeout=60) as client:
        while not (folder / "stop").exists():
            phase = (folder / "phase").read_text()
            tag = chaos_tag(worker, round_index)
            earlier = chaos_tag(worker, earlier_round(worker, round_index)) if round_index else None
            if store_and_check(client, tag, earlier, chunks, size, counts):
                acknowledged.append((tag, phase))
            round_index += 1
            rounds_in_phase[phase] = rounds_in_phase.get(phase, 0) + 1
            progress = folder / "progress" / f"{worker}.tmp"
            progress.write_text(f"{phase} {rounds_in_phase[phase]}")
            progress.replace(folder / "progress" / str(worker))
    return {"acknowledged": acknowledged, "rounds": round_index, **counts}
