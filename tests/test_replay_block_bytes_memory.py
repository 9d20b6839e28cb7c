"""``--block-bytes`` larger than this machine's memory can hold: a replay through a server
refuses it as an in-process replay does, in one line with exit code 2, before any client
asks the server anything -- not with a MemoryError traceback once the first store
allocated its blocks.

A block the server's L1 holds yet the replay cannot allocate needs more memory than a test
may take; the memory is made small instead: the replay's allocations of more than a given
number of bytes fail as numpy's do on a machine that lacks the memory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from replay_helpers import BLOCK_BYTES, small_trace, start_block_server
from thirdparty import run_cli_in_process

from lmcache_tiers.client import Client
from lmcache_tiers.replay import run


def _numpy_of_a_machine_with(memory_bytes: int) -> Any:
    """numpy, except that a ``zeros`` of more than ``memory_bytes`` raises MemoryError."""

    def zeros(shape: Any, dtype: Any = float, **kwargs: Any) -> Any:
        wanted = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if wanted > memory_bytes:
            raise MemoryError(f"Unable to allocate {wanted} bytes")  # as numpy says it
        return np.zeros(shape, dtype=dtype, **kwargs)

    return SimpleNamespace(**{**vars(np), "zeros": zeros})


def _replay(tmp_path: Path) -> tuple[Any, dict[str, int]]:
    """A replay through a server whose L1 holds 20 blocks; its result and the server's
    request counters after it."""
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    server = start_block_server(tmp_path / "server", 20)
    try:
        args = ["replay", str(trace), "--url", server.url, "--block-bytes", str(BLOCK_BYTES)]
        result = run_cli_in_process(args)
        with Client(server.url, timeout=10.0, shm=False) as probe:
            requests = probe.status()["requests"]
    finally:
        assert server.stop() == 0, server.output()
    return result, requests


def test_a_block_too_large_for_memory_is_refused_before_the_server_replay_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run, "np", _numpy_of_a_machine_with(BLOCK_BYTES - 1))  # not one block
    result, requests = _replay(tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: --block-bytes {BLOCK_BYTES}: a buffer of one block does not fit in memory; "
        "give smaller blocks"
    ], result.stderr
    assert result.stdout == ""  # no report: nothing was replayed
    assert requests["lookups"] == 0 and requests["keys_written"] == 0, requests


def test_blocks_the_memory_holds_are_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal is about the memory: under the same stand-in for numpy, blocks this
    machine can hold are replayed."""
    monkeypatch.setattr(run, "np", _numpy_of_a_machine_with(64 * BLOCK_BYTES))
    result, requests = _replay(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert requests["lookups"] == 4, requests
