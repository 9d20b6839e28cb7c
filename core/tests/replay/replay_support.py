"""Synthetic traces for the replay tests."""

import json
import random
from pathlib import Path

import pytest

from lmcache_tiers.cli.main import main


def synthetic_lines(seed: int, requests: int = 300, prompts: int = 25) -> list[dict[str, object]]:
    """Prefix-structured traffic: popular prompts (chains of block ids) sent again with a
    fresh tail of their own; every block id has exactly one parent."""
    rng = random.Random(seed)
    next_id = 0
    chains: list[list[int]] = []
    for _ in range(prompts):
        length = rng.randint(1, 12)
        chains.append(list(range(next_id, next_id + length)))
        next_id += length
    weights = [1.0 / (rank + 1) for rank in range(prompts)]
    lines = []
    for index in range(requests):
        chain = rng.choices(chains, weights)[0]
        prefix = chain[: rng.randint(1, len(chain))]
        tail = list(range(next_id, next_id + rng.randint(0, 4)))
        next_id += len(tail)
        if rng.random() < 0.3 and tail and len(prefix) == len(chain):
            chain.extend(tail[:1])  # a conversation grows: later requests reuse this tail
        blocks = prefix + tail
        lines.append(
            {
                "timestamp": index * 10,
                "input_length": 512 * len(blocks) - rng.randint(0, 511),
                "output_length": rng.randint(1, 50),
                "hash_ids": blocks,
            }
        )
    return lines


def write_trace(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_replay(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``lmcache-tiers replay ARGS`` in this process: its exit code, stdout and stderr."""
    try:
        main(["replay", *args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
