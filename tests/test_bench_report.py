"""bench/run_all.py: every benchmark's JSON read as printed, tables built from it, and a
benchmark that fails or cannot run reported as such without stopping the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_modules import load_bench

run_all = load_bench("run_all")


def test_the_last_json_document_is_read_after_progress_lines() -> None:
    assert run_all.last_json('{"a": 1}') == {"a": 1}
    assert run_all.last_json('progress 1/3\nprogress {2}\n[{"x": 2.5}]\n') == [{"x": 2.5}]
    with pytest.raises(ValueError):
        run_all.last_json("no figures here")


def test_rows_flatten_one_level_and_leave_samples_to_the_json() -> None:
    figures = [{"case": "64x1", "ratio": 0.8, "p50": {"store": 1.5}, "runs": list(range(50)), "pair": [1, 2]}]
    [(title, rows)] = run_all.tables_of(figures)
    assert title == ""
    assert rows == [{"case": "64x1", "ratio": 0.8, "p50.store": 1.5, "pair": "1 / 2"}]
    table = run_all.markdown_table(rows)
    assert table.splitlines()[0] == "| case | ratio | p50.store | pair |"
    assert "| 64x1 | 0.8 | 1.5 | 1 / 2 |" in table


def test_lists_of_records_inside_a_record_are_tables_of_their_own() -> None:
    """A comparison's rows, a benchmark's cases with their results, records in a record's
    dict: each a table titled by its path; rows of several parents say which parent."""
    figures = {
        "trace": "t.jsonl",
        "rows": [{"figure": "store", "p99": 2.5, "samples": list(range(16))}],
        "study": {
            "whole": [{"capacity": 1000, "miss": {"LRU": 0.9}}],
            "halves": {"first": [{"capacity": 5}]},
        },
    }
    tables = run_all.tables_of(figures)
    assert tables == [
        ("", [{"trace": "t.jsonl"}]),
        ("rows", [{"figure": "store", "p99": 2.5}]),
        ("study.whole", [{"capacity": 1000, "miss.LRU": 0.9}]),
        ("study.halves.first", [{"capacity": 5}]),
    ]
    cases = [
        {
            "case": "256 x 1 MiB",
            "results": [{"method": "direct", "gbps": 1.0}, {"method": "adapter", "gbps": 0.9}],
        },
        {"case": "64 x 16 MiB", "results": [{"method": "direct", "gbps": 2.0}]},
    ]
    assert run_all.tables_of(cases) == [
        ("", [{"case": "256 x 1 MiB"}, {"case": "64 x 16 MiB"}]),
        (
            "results",
            [
                {"case": "256 x 1 MiB", "method": "direct", "gbps": 1.0},
                {"case": "256 x 1 MiB", "method": "adapter", "gbps": 0.9},
                {"case": "64 x 16 MiB", "method": "direct", "gbps": 2.0},
            ],
        ),
    ]


def test_failures_and_skips_are_reported_and_the_rest_still_runs(tmp_path: Path) -> None:
    ok = tmp_path / "bench_ok.py"
    ok.write_text("import json\nprint('warming up')\nprint(json.dumps({'figure': 1.25}))\n")
    bad = tmp_path / "bench_bad.py"
    bad.write_text("import sys\nsys.exit('cannot reach the redis server')\n")
    run_all.BENCH_DIR = tmp_path
    outcomes = [
        run_all.run_bench(run_all.Bench("bad", "bench_bad.py"), False, tmp_path),
        run_all.run_bench(run_all.Bench("ref", "bench_ok.py", needs_reference=True), False, tmp_path),
        run_all.run_bench(run_all.Bench("ok", "bench_ok.py"), False, tmp_path),
    ]
    assert outcomes[0].error.startswith("exit 1: cannot reach the redis server")
    assert "has no lmcache" in outcomes[1].skipped
    assert outcomes[2].figures == {"figure": 1.25} and not outcomes[2].error
    markdown, data = run_all.write_report(outcomes, {"before": [0.1], "after": [0.2]}, tmp_path / "report")
    text = markdown.read_text()
    assert "Failed: exit 1: cannot reach the redis server" in text and "Skipped:" in text
    assert "| 1.25 |" in text
    assert json.loads(data.read_text())["benchmarks"]["ok"]["figures"] == {"figure": 1.25}


# -- the figures' own measurements, fed known timings ---------------------------------------


def test_the_single_process_memcpy_runs_alone_after_every_client_is_set_up(monkeypatch) -> None:
    """server_store's multi-client STORE: process 0's "one process alone" memcpy, and the
    concurrent memcpy phase that is the STORE's limit, start only once every process has
    its sources and its client's background population of the L1 mapping is done (that
    pass competes with the copies for the CPU; store_under_write_back waits for it too)."""
    import queue
    import threading
    import time

    server_store = load_bench("server_store")
    events: list[tuple[str, str]] = []

    class Pages:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self, timeout: float) -> bool:
            time.sleep(0.05)
            events.append(("populated", self.name))
            return True

    class FakeClient:
        def __init__(self, url: str, timeout: float, name: str) -> None:
            self._segment = type("Segment", (), {"pages": Pages(name)})()

        def __enter__(self) -> FakeClient:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def store(self, keys: list, sources: list, l1_only: bool = False) -> int:
            return len(keys)

        def evict(self, keys: list) -> int:
            return len(keys)

    real_sources = server_store._sources

    def slow_sources(count: int, size: int, seed: int) -> list:
        if seed != 100:  # every process but 0 is still making its sources
            time.sleep(0.2)
        return real_sources(count, size, seed)

    def memcpy_s(sources: list, targets: list) -> float:
        events.append(("memcpy", threading.current_thread().name))
        return 0.001

    monkeypatch.setattr(server_store, "Client", FakeClient)
    monkeypatch.setattr(server_store, "_sources", slow_sources)
    monkeypatch.setattr(server_store, "_memcpy_s", memcpy_s)
    barrier, results = threading.Barrier(2), queue.Queue()
    threads = [
        threading.Thread(
            target=server_store._client_process,
            args=("tcp://x", index, 4096, 2, 1, barrier, results),
            name=f"bench-client-{index}",
        )
        for index in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    first_copy = next(at for at, (kind, _) in enumerate(events) if kind == "memcpy")
    assert sorted(name for kind, name in events[:first_copy] if kind == "populated") == [
        "bench-client-0",
        "bench-client-1",
    ]
    assert results.qsize() == 2


def test_redis_py_pipelines_carry_the_bytes_the_adapters_do() -> None:
    """bench_redis's limit: redis-py pipelines of the same bytes per round trip as the
    adapter sends (its pipeline_max_bytes, 8 MiB), not one pipeline per ``--batch``."""
    from lmcache_plugin_redis import RedisConfig
    from lmcache_plugin_redis.backend import trips

    bench_redis = load_bench("bench_redis")
    size, count = 1 << 20, 32
    views = [memoryview(bytearray(size)) for _ in range(count)]
    targets = [memoryview(bytearray(size)) for _ in range(count)]
    config = RedisConfig(url="redis://127.0.0.1:1")
    sent: list[int] = []

    class Pipeline:
        def __init__(self) -> None:
            self.commands = 0

        def set(self, name: str, value: memoryview) -> None:
            self.commands += 1

        def get(self, name: str) -> None:
            self.commands += 1

        def execute(self) -> list[bytes]:
            sent.append(self.commands)
            return [bytes(size)] * self.commands

    direct = bench_redis.Direct(config.url, views, targets, config.pipeline_max_bytes)
    direct.client = type("Fake", (), {"pipeline": lambda self, transaction: Pipeline()})()
    expected = [len(trip) for trip in trips([size] * count, config.pipeline_max_bytes)]
    assert expected == [8, 8, 8, 8]
    direct.store(range(count))
    assert sent == expected
    sent.clear()
    direct.load(range(count))
    assert sent == expected


def test_a_block_adapters_load_is_timed_without_its_lookup(monkeypatch) -> None:
    """bench_block: the plain baselines read without asking first, so the adapter's load
    is timed alone, its lookup (which pins the keys) untimed before it, as in bench_nixl,
    bench_fs, bench_redis and bench_mooncake."""
    import time

    bench_block = load_bench("bench_block")

    class Found:
        def __init__(self, count: int) -> None:
            self.found = [True] * count

    class FakeClient:
        def __init__(self, adapter: object, timeout: float) -> None:
            pass

        def store(self, keys: list, buffers: list) -> list[bool]:
            return [True] * len(keys)

        def lookup_and_lock(self, keys: list) -> Found:
            time.sleep(0.2)
            return Found(len(keys))

        def load(self, keys: list, buffers: list) -> list[bool]:
            return [True] * len(keys)

    class FakeAdapter:
        def unlock(self, keys: list) -> None:
            pass

        def delete(self, keys: list) -> list[bool]:
            return [True] * len(keys)

    monkeypatch.setattr(bench_block, "BlockingAdapterClient", FakeClient)
    _store_s, load_s = bench_block.adapter_round(FakeAdapter(), ["k"], [memoryview(b"x")], [memoryview(b"y")])
    assert load_s < 0.1


def test_a_workload_scenario_that_fails_to_connect_stops_its_server(monkeypatch, tmp_path: Path) -> None:
    """bench_workload: the server a scenario started (its L1 segment with it) and its L2
    directory are gone again also when the scenario's client cannot connect."""
    import tempfile

    bench_workload = load_bench("bench_workload")
    signals: list[int] = []

    class FakeProc:
        pid = 12345

        def send_signal(self, number: int) -> None:
            signals.append(number)

        def wait(self, timeout: float) -> int:
            return 0

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConnectionError("no server answered")

    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(**kwargs: object) -> str:
        made.append(real_mkdtemp(dir=tmp_path))
        return made[-1]

    monkeypatch.setattr(bench_workload, "start_server", lambda *args: (FakeProc(), "tcp://127.0.0.1:1"))
    monkeypatch.setattr(bench_workload, "Client", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    shape = bench_workload.Shape(requests=1, tokens=16, chunk_tokens=16, bytes_per_token=64)
    with pytest.raises(ConnectionError):
        bench_workload.run_scenario("l2", shape, 1, "fs", "tcp")
    assert signals and made and not Path(made[0]).exists()


def test_a_server_bench_whose_server_does_not_start_leaves_no_l2_directory(
    monkeypatch, tmp_path: Path
) -> None:
    """bench_server --l2: the L2 directory it made in the working directory is removed
    also when the server it starts for it exits during start-up."""
    import sys

    bench_server = load_bench("bench_server")

    def exits(*args: object, **kwargs: object) -> None:
        raise SystemExit("the server exited with 1 during start-up")

    monkeypatch.setattr(bench_server, "start_server", exits)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_server.py", "--l2", "fs", "--json"])
    with pytest.raises(SystemExit):
        bench_server.main()
    assert list(tmp_path.iterdir()) == []


def test_the_foresight_ladder_of_a_capacity_where_lru_is_optimal_has_no_gap_to_share() -> None:
    """bench_replay's policy study at a capacity that holds the whole trace: exact LRU gets
    Belady's hits, there is no gap, and each oracle's share of it is "-", not a crash; a
    study without re-timed samples (``--seeds 0``) prints without their table."""
    from lmcache_tiers.replay.trace import Trace, TraceRequest

    bench_replay = load_bench("bench_replay")
    trace = Trace(
        "small",
        (
            TraceRequest(0.0, 1024, 1, (1, 2)),
            TraceRequest(1.0, 1536, 1, (1, 2, 3)),
        ),
    )
    study = bench_replay.policy_study(trace, [1000], [1000], 0, [0, None])
    [row] = study["foresight"]
    assert row["exact_lru"] == row["belady"]
    assert all(oracle["gap_closed"] is None for oracle in row["oracles"].values())
    bench_replay.show_study(study)
