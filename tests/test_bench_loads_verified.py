"""The benchmarks that time loads check the bytes of every timed load against what was
stored: a load that reports success but writes nothing must stop the run, not be timed as
a fast one.  The buffers a load writes into are wiped before it, so that bytes an earlier
load (or the other side of a comparison) left there cannot pass for its own."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from bench_modules import load_bench

# -- bench_workload ---------------------------------------------------------------------------


def test_a_workload_retrieve_that_writes_nothing_after_the_first_stops_the_run(monkeypatch) -> None:
    """Every request stores the same bytes, and the lookup's floor copies them into the
    retrieve's buffers: a retrieve that wrote nothing found the last request's bytes there
    and passed the byte check."""
    bench_workload = load_bench("bench_workload")
    retrieves = itertools.count()

    class FakeProc:
        pid = 12345

        def send_signal(self, number: int) -> None:
            pass

        def wait(self, timeout: float) -> int:
            return 0

    class FakeClient:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.stored: list[np.ndarray[Any, Any]] = []

        def status(self) -> dict[str, Any]:
            return {"server": {}}

        def store(self, keys: list, sources: list, layouts: list) -> int:
            self.stored = [np.array(source) for source in sources]
            return len(keys)

        def lookup(self, keys: list) -> int:
            return len(keys)

        def retrieve_into(self, keys: list, targets: list) -> int:
            if next(retrieves) == 0:  # the first one right, then nothing written
                for stored, target in zip(self.stored, targets, strict=True):
                    np.copyto(target, stored)
            return len(keys)

        def evict(self, keys: list) -> int:
            return len(keys)

        def close(self) -> None:
            pass

    class CopyingFloor:
        """The floor's placement (a copy of the request's bytes into the same buffers),
        without its round trip."""

        samples: list[float] = []

        def measure(self, request: bytes, sources: list, targets: list) -> None:
            for source, target in zip(sources, targets, strict=True):
                np.copyto(target, source)

    monkeypatch.setattr(bench_workload, "start_server", lambda *args: (FakeProc(), "tcp://127.0.0.1:1"))
    monkeypatch.setattr(bench_workload, "Client", FakeClient)
    shape = bench_workload.Shape(requests=3, tokens=32, chunk_tokens=16, bytes_per_token=64)
    with pytest.raises(SystemExit, match="retrieved bytes differ"):
        bench_workload._run_scenario("warm", shape, 1, "fs", "tcp", False, None, None, CopyingFloor())
